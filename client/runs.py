"""The step API in the SDK: a :class:`TrainingRun` (a LoRA adapter + AdamW state on a loaded session) and the
:class:`StepFuture` every primitive returns. Dataclasses in and out (``strop.common.step_types``), no protobuf.

Each primitive has a blocking form that returns its result (``run.forward_backward(...)``) and a ``*_async``
form that returns a :class:`StepFuture` at once (``run.forward_backward_async(...)``): submit several, then read
them; the trainer runs a run's primitives in submission (seq id) order. Example::

    run = tc.create_training_run(session_id, RunLora(rank=16))
    fb = run.forward_backward_async([Datum.of(tokens[:-1], target_tokens=tokens[1:], weights=w)], "cross_entropy")
    opt = run.optim_step_async(AdamParams(learning_rate=1e-4))
    print(fb.result().metrics, opt.result().metrics)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from strop.client.errors import DeadlineExceededError, error_for_code
from strop.common.serde import from_proto, to_proto
from strop.common.step_types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    Future,
    FutureState,
    LoadStateRequest,
    LossFn,
    Metric,
    OptimStepOutput,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    SaveOutput,
    SaveRequest,
    TrainingRunInfo,
)
from strop.v1 import trainer_pb2

POLL_MS = 20_000  # one GetFuture holds this long at most (the server caps it at 30 s)


class StepFuture:
    """A submitted primitive. ``result()`` waits for it (long-polling GetFuture) and returns its output, or
    raises the ``strop.client.errors`` exception of its failure (CancelledError when cancelled)."""

    def __init__(self, client: Any, future: Future):  # client: a TrainerClient (not imported: no cycle)
        self._client, self.future = client, future

    @property
    def future_id(self) -> str:
        return self.future.future_id

    @property
    def seq_id(self) -> int:
        return self.future.seq_id

    def done(self) -> bool:
        if not self.future.state.done:
            self.future = self._client.get_future(self.future_id)
        return self.future.state.done

    def cancel(self) -> Future:
        self.future = self._client.cancel_future(self.future_id)
        return self.future

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.future.state.done:
            left_ms = POLL_MS if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            if deadline is not None and left_ms <= 0:
                raise DeadlineExceededError(
                    f"future {self.future_id} not done after {timeout}s", method="StepFuture.result"
                )
            self.future = self._client.get_future(self.future_id, wait_ms=min(POLL_MS, left_ms))
        f = self.future
        if f.state is not FutureState.SUCCEEDED:
            raise error_for_code(f.error_code or "UNKNOWN", f.error, method=f.kind.value)
        return f.forward_backward or f.optim_step or f.sample or f.save


class TrainingRun:
    """A training run on the trainer (see the module docstring)."""

    def __init__(self, client: Any, info: TrainingRunInfo):
        self._client, self.info = client, info

    @property
    def run_id(self) -> str:
        return self.info.run_id

    def refresh(self) -> TrainingRunInfo:
        self.info = self._client.get_training_run(self.run_id)
        return self.info

    def delete(self) -> TrainingRunInfo:
        return self._client.delete_training_run(self.run_id)

    def _submit(self, rpc: str, msg_cls, req) -> StepFuture:
        c = self._client
        resp = c._call(getattr(c._stub, rpc), to_proto(msg_cls, req), name=rpc)
        return StepFuture(c, from_proto(Future, resp))

    # ---- futures ------------------------------------------------------------------------------------------

    def forward_backward_async(
        self,
        data: list[Datum],
        loss_fn: LossFn | str = LossFn.CROSS_ENTROPY,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        seq_id: int = 0,
        forward_only: bool = False,
    ) -> StepFuture:
        req = ForwardBackwardRequest(
            run_id=self.run_id,
            seq_id=seq_id,
            data=list(data),
            loss_fn=LossFn.parse(loss_fn),
            loss_fn_config=[Metric(k, float(v)) for k, v in (loss_fn_config or {}).items()],
            forward_only=forward_only,
        )
        return self._submit("ForwardBackward", trainer_pb2.ForwardBackwardRequest, req)

    def forward_async(
        self, data, loss_fn: LossFn | str = LossFn.CROSS_ENTROPY, loss_fn_config=None, *, seq_id: int = 0
    ):
        return self.forward_backward_async(data, loss_fn, loss_fn_config, seq_id=seq_id, forward_only=True)

    def optim_step_async(self, adam_params: AdamParams | None = None, *, seq_id: int = 0) -> StepFuture:
        req = OptimStepRequest(run_id=self.run_id, seq_id=seq_id, adam_params=adam_params)
        return self._submit("OptimStep", trainer_pb2.OptimStepRequest, req)

    def sample_async(
        self,
        prompt: list[int],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        *,
        sampler_id: str = "",
        prompt_logprobs: bool = False,
    ) -> StepFuture:
        """Sample from the snapshot ``sampler_id`` (``save_weights_for_sampler``), else from the run's live adapter."""
        req = SampleRequest(
            run_id="" if sampler_id else self.run_id,
            sampler_id=sampler_id,
            prompt=list(prompt),
            num_samples=num_samples,
            params=params or SamplingParams(),
            prompt_logprobs=prompt_logprobs,
        )
        return self._submit("Sample", trainer_pb2.SampleRequest, req)

    def save_weights_async(self, name: str = "", *, seq_id: int = 0) -> StepFuture:
        return self._submit("SaveWeights", trainer_pb2.SaveRequest, SaveRequest(self.run_id, seq_id, name))

    def save_state_async(self, name: str = "", *, seq_id: int = 0) -> StepFuture:
        return self._submit("SaveState", trainer_pb2.SaveRequest, SaveRequest(self.run_id, seq_id, name))

    def load_state_async(
        self, artifact_id: str, *, with_optimizer: bool = True, seq_id: int = 0
    ) -> StepFuture:
        req = LoadStateRequest(self.run_id, seq_id, artifact_id, with_optimizer)
        return self._submit("LoadState", trainer_pb2.LoadStateRequest, req)

    def save_weights_for_sampler_async(self, name: str = "", *, seq_id: int = 0) -> StepFuture:
        return self._submit(
            "SaveWeightsForSampler", trainer_pb2.SaveRequest, SaveRequest(self.run_id, seq_id, name)
        )

    # ---- blocking forms -----------------------------------------------------------------------------------

    def forward_backward(
        self, data, loss_fn=LossFn.CROSS_ENTROPY, loss_fn_config=None
    ) -> ForwardBackwardOutput:
        return self.forward_backward_async(data, loss_fn, loss_fn_config).result()

    def forward(self, data, loss_fn=LossFn.CROSS_ENTROPY, loss_fn_config=None) -> ForwardBackwardOutput:
        return self.forward_async(data, loss_fn, loss_fn_config).result()

    def optim_step(self, adam_params: AdamParams | None = None) -> OptimStepOutput:
        return self.optim_step_async(adam_params).result()

    def sample(
        self, prompt, num_samples=1, params=None, *, sampler_id="", prompt_logprobs=False
    ) -> SampleOutput:
        return self.sample_async(
            prompt, num_samples, params, sampler_id=sampler_id, prompt_logprobs=prompt_logprobs
        ).result()

    def save_weights(self, name: str = "") -> SaveOutput:
        return self.save_weights_async(name).result()

    def save_state(self, name: str = "") -> SaveOutput:
        return self.save_state_async(name).result()

    def load_state(self, artifact_id: str, *, with_optimizer: bool = True) -> SaveOutput:
        return self.load_state_async(artifact_id, with_optimizer=with_optimizer).result()

    def save_weights_for_sampler(self, name: str = "") -> SaveOutput:
        return self.save_weights_for_sampler_async(name).result()

    def watch(self, after_seq_id: int = 0) -> Iterator[Future]:
        """Each of the run's futures after ``after_seq_id`` as it finishes, in seq order (until the run is deleted)."""
        return self._client.watch_futures(self.run_id, after_seq_id)
