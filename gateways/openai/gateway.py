"""The gateway's operations, free of HTTP: files, fine-tuning jobs and models, each owned by the API key that made it
(its sha256). Every trainer call carries the caller's key as its bearer token, so the trainer decides the tenant;
another key's ids are 404 here as they are NOT_FOUND there. Results are the ``openai`` SDK's own types.

No key is stored: after a restart a job's follower (``jobs.JobRunner``) starts again at its owner's first request.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pydantic
from openai.types import FileDeleted, FileObject, Model, ModelDeleted
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.fine_tuning_job import Method
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

from strop.client.errors import NotFoundError, StropClientError
from strop.client.export import ExportClient
from strop.common.trainer_types import DatasetFormat, LoraConfig, Quantization
from strop.gateways.common import TrainerClients, base_models, owner_hash
from strop.gateways.openai import params
from strop.gateways.openai.errors import OpenAIError, bad, from_strop, not_found
from strop.gateways.openai.files import convert_file
from strop.gateways.openai.jobs import JobRunner, model_name, new_job_id
from strop.gateways.openai.store import GatewayStore

AUTH_TTL_S = 60.0  # a key the trainer accepted is trusted this long without asking again
MAX_PAGE = 100


@dataclass
class GatewayConfig:
    trainer: str = "127.0.0.1:50051"  # the trainer's gRPC address
    model_root: Path | None = None  # the trainer's model root, read-only: the base models served
    state_dir: Path = Path("state/openai")  # the SQLite file and the uploaded files' bytes
    database_url: str = ""  # "" (SQLite in state_dir) or postgresql://…
    quantization: Quantization = Quantization.UNSPECIFIED  # how jobs' bases are loaded
    dtype: str = ""
    max_seq_length: int = 0
    max_file_bytes: int = 512 << 20  # OpenAI's limit for a fine-tuning file
    tls_ca: str | None = None
    exporter: str = ""  # the export service's gRPC address (metadata.strop_export); "": none


def _page(items: list, after: str | None, limit: int) -> dict:
    """OpenAI's cursor page over ``items`` (already ordered): the ones after the id ``after``."""
    if not 1 <= limit <= 10_000:
        raise bad(f"'limit' must be within 1..10000, got {limit}", "limit")
    if after:
        ids = [i.id for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "has_more": len(items) > limit,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }


class Files:
    def __init__(self, gw: Gateway):
        self.gw, self.store = gw, gw.store
        self.dir = Path(gw.config.state_dir) / "files"
        self.dir.mkdir(parents=True, exist_ok=True)

    def store_file(self, owner: str, filename: str, purpose: str, data: bytes, **extra) -> dict:
        fid = f"file-{uuid.uuid4().hex[:24]}"
        tmp = self.dir / f".{fid}.partial"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / fid)
        now = time.time()
        doc = {
            "id": fid,
            "owner": owner,
            "created_at": int(now),
            "t": now,
            "filename": filename,
            "purpose": purpose,
            "bytes": len(data),
            "status": "processed",
            **extra,
        }
        self.store.put("oai_files", doc)
        return doc

    def create(self, api_key: str, filename: str, purpose: str, data: bytes) -> FileObject:
        owner = self.gw.owner(api_key)
        if purpose != "fine-tune":
            raise bad(
                f"purpose {purpose!r} is not served: this gateway stores fine-tuning files (purpose "
                "'fine-tune')",
                "purpose",
            )
        if len(data) > self.gw.config.max_file_bytes:
            raise bad(f"the file is {len(data)} bytes; the limit is {self.gw.config.max_file_bytes}", "file")
        if not data.strip():
            raise bad("the file is empty", "file")
        converted = convert_file(data)
        try:
            ds = self.gw.clients.get(api_key).upload_dataset(
                converted.data, name=filename, format=DatasetFormat.UNSPECIFIED
            )
        except StropClientError as exc:
            raise from_strop(exc, "file") from None
        doc = self.store_file(
            owner,
            filename,
            purpose,
            data,
            dataset_id=ds.dataset_id,
            kind=converted.kind,
            num_rows=ds.num_rows,
        )
        return self.wire(doc)

    @staticmethod
    def wire(doc: dict) -> FileObject:
        return FileObject(
            id=doc["id"],
            bytes=doc["bytes"],
            created_at=doc["created_at"],
            filename=doc["filename"],
            object="file",
            purpose=doc["purpose"],
            status=doc["status"],
        )

    def doc(self, api_key: str, file_id: str, param: str | None = None) -> dict:
        doc = self.store.get("oai_files", file_id)
        if doc is None or doc["owner"] != self.gw.owner(api_key):
            raise not_found("file", file_id, param)
        return doc

    def list(self, api_key: str, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        if order not in ("asc", "desc"):
            raise bad(f"'order' must be asc or desc, got {order!r}", "order")
        docs = self.store.list("oai_files", self.gw.owner(api_key))
        items = [self.wire(d) for d in docs if purpose in (None, d["purpose"])]
        return _page(items[::-1] if order == "asc" else items, after, limit)

    def delete(self, api_key: str, file_id: str) -> FileDeleted:
        self.doc(api_key, file_id)
        self.store.delete("oai_files", file_id)
        (self.dir / file_id).unlink(missing_ok=True)
        return FileDeleted(id=file_id, deleted=True, object="file")

    def content(self, api_key: str, file_id: str) -> bytes:
        self.doc(api_key, file_id)
        return (self.dir / file_id).read_bytes()


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        self.store = GatewayStore(config.database_url, Path(config.state_dir))
        self.clients = TrainerClients(config.trainer, config.tls_ca)
        self.exporters = (
            TrainerClients(config.exporter, config.tls_ca, cls=ExportClient) if config.exporter else None
        )
        self.files = Files(self)
        self.runner = JobRunner(self)
        self._lock = threading.Lock()
        self._verified: dict[str, float] = {}  # owner → when the trainer last accepted its key
        self._following: set[str] = set()  # owners whose live jobs have followers in this process

    def close(self) -> None:
        self.runner.close()
        self.clients.close()
        if self.exporters is not None:
            self.exporters.close()
        self.store.close()

    # ---- callers ------------------------------------------------------------------------------------------

    def owner(self, api_key: str | None) -> str:
        """The caller's owner id, once the trainer has accepted the key (401 otherwise)."""
        if not api_key:
            raise OpenAIError(
                "You didn't provide an API key (header Authorization: Bearer <key>)",
                401,
                code="invalid_api_key",
            )
        owner = owner_hash(api_key)
        with self._lock:
            fresh = time.monotonic() - self._verified.get(owner, -AUTH_TTL_S) < AUTH_TTL_S
        if not fresh:
            try:  # any authenticated call answers NOT_FOUND for an id no one has; an unknown key UNAUTHENTICATED
                self.clients.get(api_key).get_session("sess-openai-gateway-auth-probe")
            except NotFoundError:
                pass
            except StropClientError as exc:
                raise from_strop(exc) from None
            with self._lock:
                self._verified[owner] = time.monotonic()
                first = owner not in self._following
                self._following.add(owner)
            if first:  # this process's first request of this owner: follow its live jobs again
                for job in self.store.list("oai_jobs", owner):
                    if job.get("following"):
                        self.runner.follow(api_key, job["id"])
        return owner

    def forget_owner(self, owner: str) -> None:
        """Check the owner's key again at its next request, and follow its live jobs from there."""
        with self._lock:
            self._verified.pop(owner, None)
            self._following.discard(owner)

    # ---- jobs ---------------------------------------------------------------------------------------------

    def _job_file(self, api_key: str, file_id: str, param: str, method: str) -> dict:
        doc = self.store.get("oai_files", file_id)
        if doc is None or doc["owner"] != owner_hash(api_key):
            raise bad(f"invalid {param} {file_id!r}: no such file", param, "invalid_file")
        if doc["purpose"] != "fine-tune":
            raise bad(
                f"{param} {file_id!r} has purpose {doc['purpose']!r}; upload it with purpose fine-tune", param
            )
        kinds = params.METHOD_FILE_KINDS[method]
        if doc["kind"] not in kinds:
            raise bad(
                f"{param} {file_id!r} holds {doc['kind'].replace('_', '/')} rows; method {method} trains on "
                f"{' or '.join(k.replace('_', '/') for k in kinds)} rows",
                param,
                "invalid_file",
            )
        return doc

    def create_job(self, api_key: str, body) -> FineTuningJob:
        owner = self.owner(api_key)
        req = params.parse_create(body)
        if params.EXPORT_KEY in (req.metadata or {}) and self.exporters is None:
            raise bad(
                f"metadata {params.EXPORT_KEY!r}: this gateway has no export service (strop serve openai "
                "--exporter)",
                "metadata",
            )
        if req.model not in base_models(self.config.model_root):
            hint = " (fine-tuning a fine-tuned model is not supported)" if req.model.startswith("ft:") else ""
            raise bad(
                f"model {req.model!r} is not a base model served here{hint}; GET /v1/models lists them",
                "model",
                "model_not_available",
            )
        train = self._job_file(api_key, req.training_file, "training_file", req.method)
        valid = (
            self._job_file(api_key, req.validation_file, "validation_file", req.method)
            if req.validation_file
            else None
        )
        cfg, hyper = params.resolve(req, int(train["num_rows"]))
        job = {
            "id": new_job_id(),
            "owner": owner,
            "created_at": int(time.time()),
            "t": time.time(),
            "model": req.model,
            "training_file": req.training_file,
            "validation_file": req.validation_file,
            "suffix": req.suffix,
            "seed": req.seed,
            "metadata": req.metadata,
            "method": req.method,
            "hyperparameters": hyper,
            "config": params.config_doc(cfg),
            "lora": dataclasses.asdict(LoraConfig(seed=req.seed)),
            "dataset_id": train["dataset_id"],
            "validation_dataset_id": valid["dataset_id"] if valid else "",
            "eval_every_steps": params.eval_every(cfg, valid is not None),
            "status": "validating_files",
            "chain": [],
            "want": "",
            "following": False,
            "result_files": [],
            "grader": req.grader,
        }
        self.store.put("oai_jobs", job)
        files = f"training file: {req.training_file}" + (
            f", validation file: {req.validation_file}" if valid else ""
        )
        self.runner.event(job["id"], f"Validating {files}")
        try:
            job = self.runner.start(api_key, job)
        except BaseException:
            self.store.delete("oai_jobs", job["id"])  # a refused job leaves nothing behind
            self.store.db.execute("DELETE FROM oai_events WHERE job_id = ?", (job["id"],))
            raise
        self.runner.event(job["id"], "Files validated, moving job to queued state")
        self.runner.follow(api_key, job["id"])
        return self.job_wire(job)

    def job(self, api_key: str, job_id: str) -> dict:
        doc = self.store.get("oai_jobs", job_id)
        if doc is None or doc["owner"] != self.owner(api_key):
            raise not_found("fine-tuning job", job_id)
        return doc

    def job_wire(self, job: dict) -> FineTuningJob:
        h = job["hyperparameters"]
        method = {"type": job["method"], job["method"]: {"hyperparameters": h}}
        if job.get("grader"):
            method[job["method"]]["grader"] = job["grader"]
        try:
            method = Method.model_validate(method)
        except (
            pydantic.ValidationError
        ):  # a grader type of strop's own (numeric_check, …) the SDK does not know
            method = Method.model_construct(**method)
        out = FineTuningJob(
            id=job["id"],
            created_at=job["created_at"],
            object="fine_tuning.job",
            model=job["model"],
            organization_id=f"org-{job.get('tenant') or 'local'}",
            result_files=job.get("result_files") or [],
            seed=job["seed"],
            status="running" if job["status"] == "paused" else job["status"],
            training_file=job["training_file"],
            validation_file=job.get("validation_file"),
            hyperparameters={k: h[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
            method=method,
            metadata=job.get("metadata"),
            fine_tuned_model=job.get("fine_tuned_model"),
            finished_at=job.get("finished_at"),
            trained_tokens=job.get("trained_tokens"),
            error=job.get("error"),
            **({"strop_exports": job["exports"]} if job.get("exports") else {}),  # the SDK keeps extra fields
        )
        # "paused" is a status OpenAI's API returns (jobs.pause) that the SDK's literal does not list yet
        return out.model_copy(update={"status": "paused"}) if job["status"] == "paused" else out

    def list_jobs(self, api_key: str, after: str | None, limit: int, metadata: dict[str, str]) -> dict:
        docs = self.store.list("oai_jobs", self.owner(api_key))
        docs = [d for d in docs if all((d.get("metadata") or {}).get(k) == v for k, v in metadata.items())]
        return _page([self.job_wire(d) for d in docs], after, limit)

    def cancel_job(self, api_key: str, job_id: str) -> FineTuningJob:
        return self.job_wire(self.runner.cancel(api_key, self.job(api_key, job_id)))

    def pause_job(self, api_key: str, job_id: str) -> FineTuningJob:
        return self.job_wire(self.runner.pause(api_key, self.job(api_key, job_id)))

    def resume_job(self, api_key: str, job_id: str) -> FineTuningJob:
        return self.job_wire(self.runner.resume(api_key, self.job(api_key, job_id)))

    def events(self, api_key: str, job_id: str, after: str | None, limit: int) -> dict:
        self.job(api_key, job_id)
        if not 1 <= limit <= MAX_PAGE:
            raise bad(f"'limit' must be within 1..{MAX_PAGE}, got {limit}", "limit")
        docs, more = self.store.page("oai_events", job_id, after, limit)
        data = [FineTuningJobEvent(**d) for d in docs]
        return {"object": "list", "data": data, "has_more": more}

    def checkpoints(self, api_key: str, job_id: str, after: str | None, limit: int) -> dict:
        self.job(api_key, job_id)
        if not 1 <= limit <= MAX_PAGE:
            raise bad(f"'limit' must be within 1..{MAX_PAGE}, got {limit}", "limit")
        docs, more = self.store.page("oai_checkpoints", job_id, after, limit)
        data = [FineTuningJobCheckpoint(**{k: v for k, v in d.items() if k != "artifact_id"}) for d in docs]
        return {
            "object": "list",
            "data": data,
            "has_more": more,
            "first_id": data[0].id if data else None,
            "last_id": data[-1].id if data else None,
        }

    # ---- models -------------------------------------------------------------------------------------------

    def _base_model(self, name: str) -> Model:
        created = int((Path(self.config.model_root) / name / "config.json").stat().st_mtime)
        return Model(id=name, created=created, object="model", owned_by="strop")

    def _tuned(self, owner: str) -> dict[str, dict]:
        return {
            j["fine_tuned_model"]: j
            for j in self.store.list("oai_jobs", owner)
            if j.get("fine_tuned_model") and not j.get("model_deleted")
        }

    def _tuned_wire(self, job: dict) -> Model:
        return Model(
            id=job["fine_tuned_model"],
            created=job["finished_at"],
            object="model",
            owned_by=f"org-{job.get('tenant') or 'local'}",
        )

    def models(self, api_key: str) -> dict:
        owner = self.owner(api_key)
        data = [self._base_model(m) for m in base_models(self.config.model_root)]
        data += [self._tuned_wire(j) for j in self._tuned(owner).values()]
        return {"object": "list", "data": data}

    def model(self, api_key: str, name: str) -> Model:
        owner = self.owner(api_key)
        if name in base_models(self.config.model_root):
            return self._base_model(name)
        job = self._tuned(owner).get(name)
        if job is None:
            raise not_found("model", name, "model")
        return self._tuned_wire(job)

    def delete_model(self, api_key: str, name: str) -> ModelDeleted:
        owner = self.owner(api_key)
        if name in base_models(self.config.model_root):
            raise OpenAIError(
                f"{name!r} is a base model of the model root; only fine-tuned models can be deleted",
                403,
                param="model",
                code="model_not_deletable",
            )
        job = self._tuned(owner).get(name)
        if job is None:
            raise not_found("model", name, "model")
        try:
            self.clients.get(api_key).delete_artifact(job["adapter_id"])
        except NotFoundError:
            pass  # deleted on the trainer already
        except StropClientError as exc:
            raise from_strop(exc) from None
        self.store.update("oai_jobs", job["id"], model_deleted=True)
        return ModelDeleted(id=name, deleted=True, object="model")


__all__ = ["Gateway", "GatewayConfig", "model_name"]
