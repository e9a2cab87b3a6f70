"""The OpenAI gateway's test stack: a real trainer (token file with two tenants) and the real gateway (uvicorn) on
127.0.0.1, over the session's tiny fp32 Llama. Imported by the test modules that use it (one stack a module)."""

from __future__ import annotations

import json
import time

from tests.gateways.conftest import Served, free_port

KEY_A = "sk-tenant-a-openai-0123456789"
KEY_B = "sk-tenant-b-openai-9876543210"
MAX_QUEUED = 1  # the trainer's queue: one job waits while one runs, a third is RESOURCE_EXHAUSTED (429)


class ServedGateway(Served):
    """The OpenAI gateway over ``trainer`` with its state in ``state_dir``, served by uvicorn in a thread."""

    def __init__(self, trainer: str, model_root, state_dir, exporter: str = ""):
        from strop.common.trainer_types import Quantization
        from strop.gateways.openai.app import create_app
        from strop.gateways.openai.gateway import Gateway, GatewayConfig

        gw = Gateway(
            GatewayConfig(
                trainer=trainer,
                model_root=model_root,
                state_dir=state_dir,
                quantization=Quantization.NONE,
                dtype="float32",
                exporter=exporter,
            )
        )
        super().__init__(gw, free_port(), create_app(gw))
        self.url += "/v1"


class Stack:
    def __init__(self, model_root, work):
        from strop.common.auth import TokenTable
        from strop.common.grpc_server import Security
        from strop.trainer_svc.core.trainer_core import TrainerConfig
        from strop.trainer_svc.server import start

        self.model_root, self.work = model_root, work
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
            max_queued_jobs=MAX_QUEUED,
        )
        from strop.export_svc.server import ExportConfig
        from strop.export_svc.server import start as start_export

        security = Security(tokens=TokenTable.load(tokens))
        self.trainer_config, self.security = config, security
        self.trainer = start(config, security=security)
        # the export service on the same artifact store (jobs whose metadata asks for exports)
        self.exporter = start_export(
            ExportConfig(model_root, work / "artifacts", work / "export"), security=security
        )
        self.exporter_address = f"127.0.0.1:{self.exporter.running.port}"
        self.gateway = ServedGateway(
            self.trainer_address, model_root, work / "gateway", self.exporter_address
        )

    @property
    def trainer_address(self) -> str:
        return f"127.0.0.1:{self.trainer.running.port}"

    @property
    def url(self) -> str:
        return self.gateway.url

    def restart_gateway(self) -> None:
        """Stop the gateway and start a new one on the same state (another port)."""
        self.gateway.stop()
        self.gateway = ServedGateway(
            self.trainer_address, self.model_root, self.work / "gateway", self.exporter_address
        )

    def restart_trainer(self) -> None:
        """Stop the trainer (draining: a running job stops INTERRUPTED at a step, checkpointed) and start it again on
        the same port and state, as a pod restart does."""
        from strop.trainer_svc.server import start

        address = self.trainer_address
        self.trainer.stop(grace=30.0)
        self.trainer = start(self.trainer_config, address=address, security=self.security)

    def client(self, key: str = KEY_A):
        import openai

        # no retries: a 429 or 5xx must reach the test as the SDK's exception, at once
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.gateway.stop()
        self.exporter.stop(grace=5.0)
        self.trainer.stop(grace=5.0)


def running_stack(model_root, tmp_path_factory):
    """A test module's stack fixture: ``yield from running_stack(model_root, tmp_path_factory)``."""
    stack = Stack(model_root, tmp_path_factory.mktemp("openai"))
    yield stack
    stack.stop()


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    """Chat rows the tiny model can learn: a fixed answer per question."""
    return [
        {
            "messages": [
                {"role": "system", "content": "You answer with a number."},
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(offset, offset + n)
    ]


def preference_rows(n: int) -> list[dict]:
    return [
        {
            "input": {"messages": [{"role": "user", "content": f"Say {i} politely."}]},
            "preferred_output": [{"role": "assistant", "content": f"Certainly: {i}."}],
            "non_preferred_output": [{"role": "assistant", "content": f"{i}!!"}],
        }
        for i in range(n)
    ]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_status(client, job_id: str, statuses: tuple[str, ...], timeout: float = 120.0):
    """Poll the job (as an OpenAI pipeline does) until its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stayed {job.status} (waiting for {statuses})"
        time.sleep(0.1)
