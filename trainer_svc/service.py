"""The thin gRPC layer over TrainerCore: protobuf in, dataclasses to the core, protobuf out."""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from collections.abc import Iterator

import grpc

from strop.common import step_types as st
from strop.common.aio import follow, in_pool
from strop.common.artifact_service import ArtifactServicer
from strop.common.errors import InvalidArgument
from strop.common.grpc_server import Drain
from strop.common.serde import from_proto, to_proto
from strop.common.trainer_types import DatasetHeader, LoadModelRequest, LoraConfig, StateChange, TrainConfig
from strop.trainer_svc.core.trainer_core import TrainerCore
from strop.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

REPLAY_PAGE = 100  # events a stream takes per turn (a turn of a few ms on a CPU; see common.aio._FairGate)
CACHED_EVENTS = 50_000  # converted event messages kept for replays (a few hundred bytes each)


class TrainerServicer(ArtifactServicer, trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, core: TrainerCore, drain: Drain):
        self.core, self.drain, self.artifacts = core, drain, core.artifacts
        self._protos: collections.OrderedDict[tuple[str, int], trainer_pb2.JobEvent] = (
            collections.OrderedDict()
        )
        self._protos_lock = threading.Lock()

    def LoadModel(self, request, context):
        self.drain.check()
        return to_proto(trainer_pb2.Session, self.core.sessions.load(from_proto(LoadModelRequest, request)))

    def AttachLora(self, request, context):
        lora = from_proto(LoraConfig, request.lora) if request.HasField("lora") else LoraConfig()
        return to_proto(trainer_pb2.Session, self.core.sessions.attach_lora(request.session_id, lora))

    def GetSession(self, request, context):
        return to_proto(trainer_pb2.Session, self.core.sessions.get(request.session_id))

    def ListSessions(self, request, context):
        sessions = self.core.sessions.list(request.include_closed)
        return trainer_pb2.ListSessionsResponse(sessions=[to_proto(trainer_pb2.Session, s) for s in sessions])

    def CloseSession(self, request, context):
        return to_proto(trainer_pb2.Session, self.core.sessions.close(request.session_id))

    def Generate(self, request, context):
        completions = self.core.sessions.generate(
            request.session_id,
            list(request.prompts),
            max_new_tokens=request.max_new_tokens,
            disable_adapter=request.disable_adapter,
            apply_chat_template=request.apply_chat_template,
            time_budget=context.time_remaining(),  # None without a deadline
        )
        return trainer_pb2.GenerateResponse(completions=completions)

    def SaveAdapter(self, request, context):
        return to_proto(
            common_pb2.Artifact, self.core.sessions.save_adapter(request.session_id, request.name)
        )

    def UploadDataset(self, request_iterator, context):
        self.drain.check()
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("the first UploadDataset message must be the header")
        header = from_proto(DatasetHeader, first.header)

        def data() -> Iterator[bytes]:
            for msg in request_iterator:
                if msg.WhichOneof("part") != "data":
                    raise InvalidArgument("only the first UploadDataset message may be a header")
                yield msg.data

        info = self.core.datasets.upload(
            header.name, header.format, data(), expect_bytes=header.size_bytes, expect_sha256=header.sha256
        )
        return to_proto(trainer_pb2.Dataset, info)

    def RegisterDataset(self, request, context):
        header = from_proto(DatasetHeader, request.header)
        return to_proto(
            trainer_pb2.Dataset, self.core.datasets.register(request.path, header.name, header.format)
        )

    def GetDataset(self, request, context):
        return to_proto(trainer_pb2.Dataset, self.core.datasets.get(request.dataset_id))

    def ListDatasets(self, request, context):
        return trainer_pb2.ListDatasetsResponse(
            datasets=[to_proto(trainer_pb2.Dataset, d) for d in self.core.datasets.list()]
        )

    async def Train(self, request, context):
        self.drain.check()
        config = from_proto(TrainConfig, request.config) if request.HasField("config") else None
        job = await in_pool(
            self.core.jobs.start,
            request.session_id,
            request.dataset_id,
            config,
            resume_from_job_id=request.resume_from_job_id,
            name=request.name,
            fail_if_busy=request.fail_if_busy,
            validation_dataset_id=request.validation_dataset_id,
        )
        async for event in self._events(job.job_id, 0, context):
            yield event

    async def WatchJob(self, request, context):
        async for event in self._events(request.job_id, request.after_seq, context):
            yield event

    def _events(self, job_id: str, after_seq: int, context):
        poll = functools.partial(self.core.jobs.poll, job_id)
        return follow(
            poll,
            self.core.store.changed,
            after_seq,
            context=context,
            convert=self._event_proto,
            page_size=REPLAY_PAGE,
        )

    def _event_proto(self, event):
        """An event's message, converted once for all the streams that replay it (events never change)."""
        key = (event.job_id, event.seq)
        with self._protos_lock:
            msg = self._protos.get(key)
        if msg is None:
            msg = to_proto(trainer_pb2.JobEvent, event)
            with self._protos_lock:
                self._protos[key] = msg
                while len(self._protos) > CACHED_EVENTS:
                    self._protos.popitem(last=False)
        return msg

    def GetJob(self, request, context):
        return to_proto(trainer_pb2.Job, self.core.jobs.get(request.job_id))

    def ListJobs(self, request, context):
        states = [from_proto(StateChange, trainer_pb2.StateChange(state=s)).state for s in request.states]
        jobs = self.core.jobs.list(request.session_id, states or None)
        return trainer_pb2.ListJobsResponse(jobs=[to_proto(trainer_pb2.Job, j) for j in jobs])

    def CancelJob(self, request, context):
        return to_proto(trainer_pb2.Job, self.core.jobs.cancel(request.job_id))

    # ---- the step API (core/runs.py): each method converts once and calls the core ----------------------------

    def CreateTrainingRun(self, request, context):
        self.drain.check()
        req = from_proto(st.CreateTrainingRun, request)
        return to_proto(trainer_pb2.TrainingRun, self.core.runs.create(req))

    def GetTrainingRun(self, request, context):
        return to_proto(trainer_pb2.TrainingRun, self.core.runs.get(request.run_id))

    def ListTrainingRuns(self, request, context):
        runs = self.core.runs.list(request.session_id)
        return trainer_pb2.ListTrainingRunsResponse(runs=[to_proto(trainer_pb2.TrainingRun, r) for r in runs])

    def DeleteTrainingRun(self, request, context):
        return to_proto(trainer_pb2.TrainingRun, self.core.runs.delete(request.run_id))

    def _future(self, submit, req_cls, request):
        self.drain.check()
        return to_proto(trainer_pb2.Future, submit(from_proto(req_cls, request)))

    def ForwardBackward(self, request, context):
        return self._future(self.core.runs.forward_backward, st.ForwardBackwardRequest, request)

    def OptimStep(self, request, context):
        return self._future(self.core.runs.optim_step, st.OptimStepRequest, request)

    def Sample(self, request, context):
        return self._future(self.core.runs.sample, st.SampleRequest, request)

    def SaveWeights(self, request, context):
        return self._future(self.core.runs.save_weights, st.SaveRequest, request)

    def SaveState(self, request, context):
        return self._future(self.core.runs.save_state, st.SaveRequest, request)

    def LoadState(self, request, context):
        return self._future(self.core.runs.load_state, st.LoadStateRequest, request)

    def SaveWeightsForSampler(self, request, context):
        return self._future(self.core.runs.save_weights_for_sampler, st.SaveRequest, request)

    async def GetFuture(self, request, context):
        if request.wait_ms < 0:
            raise InvalidArgument(f"wait_ms must be >= 0, got {request.wait_ms}")
        wait = min(request.wait_ms, MAX_FUTURE_WAIT_MS) / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline, pending or not
            wait = max(0.0, min(wait, remaining - 0.2))
        future = await _poll(
            lambda: self.core.runs.get_future(request.future_id), lambda f: f.state.done, wait
        )
        return to_proto(trainer_pb2.Future, future)

    def CancelFuture(self, request, context):
        return to_proto(trainer_pb2.Future, self.core.runs.cancel(request.future_id))

    async def WatchFutures(self, request, context):
        seq = request.after_seq_id + 1
        while True:
            done, ended = await _poll(
                functools.partial(self.core.runs.seq_done, request.run_id, seq),
                lambda r: r[0] is not None or r[1],
                30.0,
            )
            if done is not None:
                yield to_proto(trainer_pb2.Future, done)
                seq += 1
            elif ended:
                return


async def _poll(read, ready, seconds: float):
    """``read()`` until ``ready`` or ``seconds`` pass, sleeping on the event loop between reads (5 ms doubling to
    100 ms): a long-poll holds no thread, so thousands of waiting clients cost nothing but timers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    value, delay = read(), 0.005
    while not ready(value) and loop.time() < deadline:
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.1)
        value = read()
    return value


MAX_FUTURE_WAIT_MS = (
    30_000  # one GetFuture holds at most this long (a gateway long-polls under Tinker's 45 s)
)


def add_to_server(servicer: TrainerServicer, server: grpc.Server) -> None:
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)


SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
