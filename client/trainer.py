"""Synchronous SDK for the trainer service. Dataclasses in and out; streams are iterators.

Example::

    from strop.client import TrainerClient, TrainConfig, TrainMethod, LoraConfig

    with TrainerClient("localhost:50051") as tc:
        session = tc.load_model("tiny-llama-4bit")
        tc.attach_lora(session.session_id, LoraConfig(r=16, alpha=16))
        ds = tc.upload_dataset("data.jsonl")
        for event in tc.train(session.session_id, ds.dataset_id, TrainConfig(method=TrainMethod.SFT, max_steps=100)):
            if event.step:
                print(event.step.step, event.step.loss)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from strop.client._base import LONG_TIMEOUT, ArtifactClient
from strop.client.runs import StepFuture, TrainingRun
from strop.common.serde import from_proto, to_proto
from strop.common.step_types import AdamParams, CreateTrainingRun, Future, RunLora, TrainingRunInfo
from strop.common.trainer_types import (
    Artifact,
    DatasetFormat,
    DatasetHeader,
    DatasetInfo,
    JobEvent,
    JobInfo,
    JobState,
    KernelMode,
    LoadModelRequest,
    LoraConfig,
    Quantization,
    SessionInfo,
    StateChange,
    TrainConfig,
)
from strop.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

UPLOAD_CHUNK = 1 << 20


class TrainerClient(ArtifactClient):
    """Client of ``strop.v1.TrainerService``. Every call raises a ``strop.client.errors`` exception on failure."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    # sessions
    def load_model(
        self,
        model_path: str,
        *,
        quantization: Quantization = Quantization.UNSPECIFIED,
        dtype: str = "",
        max_seq_length: int = 0,
        kernels: KernelMode = KernelMode.UNSPECIFIED,
        name: str = "",
        shared: bool = False,
        timeout: float = LONG_TIMEOUT,
    ) -> SessionInfo:
        req = LoadModelRequest(model_path, quantization, dtype, max_seq_length, kernels, name, shared)
        return self._session(
            self._call(
                self._stub.LoadModel,
                to_proto(trainer_pb2.LoadModelRequest, req),
                timeout=timeout,
                name="LoadModel",
            )
        )

    def attach_lora(self, session_id: str, lora: LoraConfig | None = None) -> SessionInfo:
        req = trainer_pb2.AttachLoraRequest(
            session_id=session_id, lora=to_proto(common_pb2.LoraConfig, lora or LoraConfig())
        )
        return self._session(self._call(self._stub.AttachLora, req, name="AttachLora"))

    def get_session(self, session_id: str) -> SessionInfo:
        return self._session(
            self._call(
                self._stub.GetSession, trainer_pb2.GetSessionRequest(session_id=session_id), name="GetSession"
            )
        )

    def list_sessions(self, include_closed: bool = False) -> list[SessionInfo]:
        resp = self._call(
            self._stub.ListSessions,
            trainer_pb2.ListSessionsRequest(include_closed=include_closed),
            name="ListSessions",
        )
        return [self._session(s) for s in resp.sessions]

    def close_session(self, session_id: str) -> SessionInfo:
        return self._session(
            self._call(
                self._stub.CloseSession,
                trainer_pb2.CloseSessionRequest(session_id=session_id),
                name="CloseSession",
            )
        )

    def generate(
        self,
        session_id: str,
        prompts: list[str] | str,
        *,
        max_new_tokens: int = 64,
        disable_adapter: bool = False,
        apply_chat_template: bool = False,
        timeout: float = LONG_TIMEOUT,
    ) -> list[str]:
        """Greedy completions (new text only) for each prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        req = trainer_pb2.GenerateRequest(
            session_id=session_id,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            disable_adapter=disable_adapter,
            apply_chat_template=apply_chat_template,
        )
        return list(self._call(self._stub.Generate, req, timeout=timeout, name="Generate").completions)

    def save_adapter(self, session_id: str, name: str = "") -> Artifact:
        resp = self._call(
            self._stub.SaveAdapter,
            trainer_pb2.SaveAdapterRequest(session_id=session_id, name=name),
            timeout=LONG_TIMEOUT,
            name="SaveAdapter",
        )
        return from_proto(Artifact, resp)

    # datasets
    def upload_dataset(
        self,
        source: str | os.PathLike | bytes | Iterable[dict],
        *,
        name: str = "",
        format: DatasetFormat = DatasetFormat.UNSPECIFIED,
    ) -> DatasetInfo:
        """Upload JSONL: a file path, raw bytes, or an iterable of row dicts (serialised here)."""
        import json

        if isinstance(source, bytes):
            data, default_name = source, "upload.jsonl"
        elif isinstance(source, str | os.PathLike):
            data, default_name = Path(source).read_bytes(), Path(source).name
        else:
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in source).encode()
            default_name = "rows.jsonl"
        header = to_proto(
            trainer_pb2.DatasetHeader,
            DatasetHeader(name or default_name, format, len(data), hashlib.sha256(data).hexdigest()),
        )

        def requests() -> Iterator[trainer_pb2.UploadDatasetRequest]:
            yield trainer_pb2.UploadDatasetRequest(header=header)
            for i in range(0, len(data), UPLOAD_CHUNK):
                yield trainer_pb2.UploadDatasetRequest(data=data[i : i + UPLOAD_CHUNK])

        resp = self._call(self._stub.UploadDataset, requests(), timeout=LONG_TIMEOUT, name="UploadDataset")
        return from_proto(DatasetInfo, resp)

    def register_dataset(
        self, path: str, *, name: str = "", format: DatasetFormat = DatasetFormat.UNSPECIFIED
    ) -> DatasetInfo:
        req = trainer_pb2.RegisterDatasetRequest(
            path=path, header=to_proto(trainer_pb2.DatasetHeader, DatasetHeader(name, format))
        )
        return from_proto(
            DatasetInfo,
            self._call(self._stub.RegisterDataset, req, timeout=LONG_TIMEOUT, name="RegisterDataset"),
        )

    def get_dataset(self, dataset_id: str) -> DatasetInfo:
        return from_proto(
            DatasetInfo,
            self._call(
                self._stub.GetDataset, trainer_pb2.GetDatasetRequest(dataset_id=dataset_id), name="GetDataset"
            ),
        )

    def list_datasets(self) -> list[DatasetInfo]:
        resp = self._call(self._stub.ListDatasets, trainer_pb2.ListDatasetsRequest(), name="ListDatasets")
        return [from_proto(DatasetInfo, d) for d in resp.datasets]

    # jobs
    def train(
        self,
        session_id: str,
        dataset_id: str = "",
        config: TrainConfig | None = None,
        *,
        resume_from_job_id: str = "",
        name: str = "",
        fail_if_busy: bool = False,
        validation_dataset_id: str = "",
        timeout: float | None = None,
    ) -> Iterator[JobEvent]:
        """Start a job and stream its events until it ends. Closing the iterator detaches; the job goes on.

        A session busy with another job: the new one waits QUEUED behind it, unless ``fail_if_busy``
        (FailedPreconditionError then). ``validation_dataset_id``: held-out rows in the training set's format,
        evaluated every ``config.eval_every_steps`` and at the end (``JobEvent.eval``; docs/validation.md)."""
        req = trainer_pb2.TrainRequest(
            session_id=session_id,
            dataset_id=dataset_id,
            resume_from_job_id=resume_from_job_id,
            name=name,
            fail_if_busy=fail_if_busy,
            validation_dataset_id=validation_dataset_id,
        )
        if config is not None:
            req.config.CopyFrom(to_proto(trainer_pb2.TrainConfig, config))
        for ev in self._stream(self._stub.Train, req, timeout=timeout, name="Train"):
            yield from_proto(JobEvent, ev)

    def watch_job(
        self, job_id: str, after_seq: int = 0, *, timeout: float | None = None
    ) -> Iterator[JobEvent]:
        """Every event after ``after_seq`` (replayed from the service's log), then live ones until the job ends."""
        req = trainer_pb2.WatchJobRequest(job_id=job_id, after_seq=after_seq)
        for ev in self._stream(self._stub.WatchJob, req, timeout=timeout, name="WatchJob"):
            yield from_proto(JobEvent, ev)

    def get_job(self, job_id: str) -> JobInfo:
        return from_proto(
            JobInfo, self._call(self._stub.GetJob, trainer_pb2.GetJobRequest(job_id=job_id), name="GetJob")
        )

    def list_jobs(self, session_id: str = "", states: Iterable[JobState] = ()) -> list[JobInfo]:
        req = trainer_pb2.ListJobsRequest(session_id=session_id)
        req.states.extend(to_proto(trainer_pb2.StateChange, StateChange(s)).state for s in states)
        return [from_proto(JobInfo, j) for j in self._call(self._stub.ListJobs, req, name="ListJobs").jobs]

    def cancel_job(self, job_id: str) -> JobInfo:
        return from_proto(
            JobInfo,
            self._call(self._stub.CancelJob, trainer_pb2.CancelJobRequest(job_id=job_id), name="CancelJob"),
        )

    def wait_job(self, job_id: str, *, timeout: float | None = None) -> JobInfo:
        """Follow the job's events to its end (re-attaching as needed) and return the final job."""
        for _ in self.watch_job(job_id, timeout=timeout):
            pass
        return self.get_job(job_id)

    # artifacts: get_artifact, list_artifacts, download_artifact (ArtifactClient)

    @staticmethod
    def _session(msg) -> SessionInfo:
        return from_proto(SessionInfo, msg)

    # the step API (strop.client.runs)
    def create_training_run(
        self,
        session_id: str,
        lora: RunLora | None = None,
        optimizer: AdamParams | None = None,
        *,
        name: str = "",
        from_state: str = "",
        with_optimizer: bool = True,
    ) -> TrainingRun:
        """A new training run on a loaded session (without AttachLora); ``from_state``: a SaveState artifact to
        start from (its LoRA config; Adam's state and step too with ``with_optimizer``)."""
        req = CreateTrainingRun(session_id, lora, optimizer, name, from_state, with_optimizer)
        resp = self._call(
            self._stub.CreateTrainingRun,
            to_proto(trainer_pb2.CreateTrainingRunRequest, req),
            name="CreateTrainingRun",
        )
        return TrainingRun(self, from_proto(TrainingRunInfo, resp))

    def training_run(self, run_id: str) -> TrainingRun:
        return TrainingRun(self, self.get_training_run(run_id))

    def get_training_run(self, run_id: str) -> TrainingRunInfo:
        resp = self._call(
            self._stub.GetTrainingRun, trainer_pb2.GetTrainingRunRequest(run_id=run_id), name="GetTrainingRun"
        )
        return from_proto(TrainingRunInfo, resp)

    def list_training_runs(self, session_id: str = "") -> list[TrainingRunInfo]:
        resp = self._call(
            self._stub.ListTrainingRuns,
            trainer_pb2.ListTrainingRunsRequest(session_id=session_id),
            name="ListTrainingRuns",
        )
        return [from_proto(TrainingRunInfo, r) for r in resp.runs]

    def delete_training_run(self, run_id: str) -> TrainingRunInfo:
        resp = self._call(
            self._stub.DeleteTrainingRun,
            trainer_pb2.DeleteTrainingRunRequest(run_id=run_id),
            name="DeleteTrainingRun",
        )
        return from_proto(TrainingRunInfo, resp)

    def get_future(self, future_id: str, *, wait_ms: int = 0) -> Future:
        """A step future's state (and result once done); ``wait_ms`` holds the call until it is done."""
        req = trainer_pb2.GetFutureRequest(future_id=future_id, wait_ms=wait_ms)
        timeout = max(self.timeout, wait_ms / 1000.0 + 10.0)
        return from_proto(Future, self._call(self._stub.GetFuture, req, timeout=timeout, name="GetFuture"))

    def future(self, future_id: str) -> StepFuture:
        return StepFuture(self, self.get_future(future_id))

    def cancel_future(self, future_id: str) -> Future:
        req = trainer_pb2.CancelFutureRequest(future_id=future_id)
        return from_proto(Future, self._call(self._stub.CancelFuture, req, name="CancelFuture"))

    def watch_futures(self, run_id: str, after_seq_id: int = 0) -> Iterator[Future]:
        req = trainer_pb2.WatchFuturesRequest(run_id=run_id, after_seq_id=after_seq_id)
        for msg in self._stream(self._stub.WatchFutures, req, name="WatchFutures"):
            yield from_proto(Future, msg)
