from __future__ import annotations

import json
import socket
import threading
import time

import pytest

KEY_A = "tml-tenant-a-0123456789"
KEY_B = "tml-tenant-b-9876543210"
ADMIN = "tml-ops-admin-5555555555"  # the gateway's admin token: it loads the shared bases


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A gateway served by uvicorn in a thread on 127.0.0.1:``port`` (its ``app``; default the Tinker gateway's app
    over ``gw``); ``stop()`` ends it as SIGTERM would."""

    def __init__(self, gw, port: int, app=None):
        import uvicorn

        from strop.gateways.tinker.app import create_app

        self.gw, self.url = gw, f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            app or create_app(gw),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the gateway did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "the gateway did not stop"
        self.gw.close()


@pytest.fixture(scope="module")
def tinker_stack(model_root, tmp_path_factory):
    """A real trainer (tokens for two tenants, each a Tinker API key, and an admin) and the real gateway (uvicorn)
    on 127.0.0.1, holding the admin token."""
    from strop.common.auth import TokenTable
    from strop.common.grpc_server import Security
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = tmp_path_factory.mktemp("tinker")
    tokens = work / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"tenant": "a", "token": KEY_A},
                    {"tenant": "b", "token": KEY_B},
                    {"tenant": "ops", "token": ADMIN, "role": "admin"},
                ]
            }
        )
    )
    (work / "data").mkdir()
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=work / "artifacts",
        state_dir=work / "state",
        data_root=work / "data",
    )
    service = start(config, security=Security(tokens=TokenTable.load(tokens)))
    served = Served(gateway(f"127.0.0.1:{service.running.port}", model_root), free_port())
    yield served.url, served.gw, service
    served.stop()
    service.stop(grace=5.0)


def gateway(trainer: str, model_root, **kw):
    from strop.common.trainer_types import Quantization
    from strop.gateways.tinker.gateway import Gateway, GatewayConfig

    return Gateway(
        GatewayConfig(
            **{
                "trainer": trainer,
                "model_root": model_root,
                "quantization": Quantization.NONE,
                "dtype": "float32",
                "poll_ms": 2_000,
                "default_max_tokens": 8,
                "max_chunk_datums": 2,  # the SDK splits a forward_backward of more datums into chunks sent concurrently
                "admin_token": ADMIN,
                **kw,
            }
        )
    )
