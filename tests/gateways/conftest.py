from __future__ import annotations

import json
import socket
import threading
import time

import pytest

KEY_A = "tml-tenant-a-0123456789"
KEY_B = "tml-tenant-b-9876543210"


@pytest.fixture(scope="module")
def tinker_stack(model_root, tmp_path_factory):
    """A real trainer (tokens for two tenants, each a Tinker API key) and the real gateway (uvicorn) on 127.0.0.1."""
    import uvicorn

    from strop.common.auth import TokenTable
    from strop.common.grpc_server import Security
    from strop.common.trainer_types import Quantization
    from strop.gateways.tinker.app import create_app
    from strop.gateways.tinker.gateway import Gateway, GatewayConfig
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = tmp_path_factory.mktemp("tinker")
    tokens = work / "tokens.json"
    tokens.write_text(
        json.dumps({"tokens": [{"tenant": "a", "token": KEY_A}, {"tenant": "b", "token": KEY_B}]})
    )
    (work / "data").mkdir()
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=work / "artifacts",
        state_dir=work / "state",
        data_root=work / "data",
    )
    service = start(config, security=Security(tokens=TokenTable.load(tokens)))
    gw = Gateway(GatewayConfig(
        trainer=f"127.0.0.1:{service.running.port}", model_root=model_root, quantization=Quantization.NONE,
        dtype="float32", poll_ms=2_000, default_max_tokens=8,
        max_chunk_datums=2,  # the SDK splits a forward_backward of more datums into chunks sent concurrently
    ))  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", gw, service
    server.should_exit = True
    thread.join(10)
    gw.close()
    service.stop(grace=5.0)
