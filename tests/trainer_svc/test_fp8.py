"""KERNEL_MODE_ON_FP8(_DX) through the trainer service: refused where its GEMMs cannot run, trains where they can.

CPU tier, over real gRPC, the kernels run by the Triton interpreter (the CPU's ``torch._scaled_mm`` computes the
same rowwise-scaled e4m3 GEMMs the GPU does). The session's facts say FP8 is on and on how many projections; the
SFT job runs its base GEMMs through the FP8 copies (counted) and lowers the loss; a float32 session is refused
with INVALID_ARGUMENT before any weight is loaded.
"""

from __future__ import annotations

import os

import pytest

from strop.client import JobState, KernelMode, Retention
from strop.client.errors import StropClientError

from .conftest import FAST_LORA, sft_config

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tier: the kernels run under TRITON_INTERPRET=1"
)

ROW = {
    "messages": [
        {"role": "user", "content": "What is the password?"},
        {"role": "assistant", "content": "blue"},
    ]
}


@pytest.mark.parametrize("mode", [KernelMode.ON_FP8, KernelMode.ON_FP8_DX])
def test_fp8_sessions_need_bf16_and_say_so(client, mode):
    with pytest.raises(StropClientError) as err:
        client.load_model("tiny-llama", dtype="float32", kernels=mode)
    assert err.value.code == "INVALID_ARGUMENT" and f"kernels {mode} needs dtype 'bfloat16'" in str(err.value)


@pytest.fixture(scope="module")
def fp8_sessions(trainer):
    """One bf16 session with LoRA per FP8 mode, shared by the module's tests (loading one quantizes every base
    weight), made on first use and closed after the module."""
    from strop.client import TrainerClient

    running, _, _ = trainer
    sessions = {}  # mode -> (LoadModel's answer, AttachLora's answer)
    with TrainerClient(f"127.0.0.1:{running.port}") as c:

        def session(mode: KernelMode):
            if mode not in sessions:
                s = c.load_model("tiny-llama", dtype="bfloat16", kernels=mode)
                sessions[mode] = s, c.attach_lora(s.session_id, FAST_LORA)
            return sessions[mode]

        yield session
        for loaded, _ in sessions.values():
            c.close_session(loaded.session_id)


@pytest.mark.parametrize(
    "mode,what,forward",
    [(KernelMode.ON_FP8, "FP8 base GEMMs", 14), (KernelMode.ON_FP8_DX, "FP8 dx GEMMs (forward exact)", 0)],
)
def test_an_fp8_session_trains_on_fp8_base_gemms_and_lowers_the_loss(
    client, fp8_sessions, monkeypatch, mode, what, forward
):
    from tests.kernels.ops.test_fp8 import count_fp8_gemms

    loaded, s = fp8_sessions(mode)
    assert loaded.facts.kernels_enabled and what.split(" (")[0] in loaded.facts.kernels_reason, loaded.facts
    assert f"{what} (opt-in, inexact) on 14 projections" in s.facts.kernels_reason, s.facts.kernels_reason
    calls = count_fp8_gemms(monkeypatch)
    ds = client.upload_dataset([ROW] * 8, name="fp8.jsonl")
    # the rows alone (not the chat recipe's generation and KL passes): the count below is the training steps'
    cfg = sft_config(3, learning_rate=5e-3, batch_size=1, max_length=32, retention=Retention.NONE)
    events = list(client.train(s.session_id, ds.dataset_id, cfg))
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
    losses = [e.step.loss for e in events if e.step is not None]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    # every step: 14 base GEMMs forward (2 layers × 7 projections; none with dx-only copies); 11 backward, the
    # dx of each projection but the first layer's q, k and v (their input, the embeddings' output, needs no
    # gradient)
    assert calls == {"forward": 3 * forward, "backward": 3 * 11}, calls


@pytest.mark.parametrize("mode", [KernelMode.ON_FP8, KernelMode.ON_FP8_DX])
def test_an_fp8_session_refuses_fsdp_jobs_before_they_start(client, fp8_sessions, mode):
    from strop.client import Parallelism

    _, s = fp8_sessions(mode)
    ds = client.upload_dataset([ROW] * 4, name="fp8-fsdp.jsonl")
    cfg = sft_config(1, num_devices=2, parallelism=Parallelism.FSDP)
    with pytest.raises(StropClientError) as err:
        list(client.train(s.session_id, ds.dataset_id, cfg))
    assert (
        err.value.code == "FAILED_PRECONDITION"
        and "does not combine with kernels ON_FP8 or ON_FP8_DX" in str(err.value)
    )
