"""GPU tier: on CUDA the trainer patches strop's kernels by default and trains the same thing as HF + PEFT."""

from __future__ import annotations

import pytest

from strop.client import JobState, KernelMode, MemoryMode, Retention, TrainConfig, TrainMethod
from strop.demo.data import ANSWER, QUESTION, dpo_rows
from tests.trainer_svc.conftest import FAST_LORA, sft_config

pytestmark = pytest.mark.gpu


def _losses(events):
    return [e.step.loss for e in events if e.step is not None]


def test_cuda_sessions_use_the_kernels_by_default_and_match_unpatched_training(client, sft_dataset):
    runs = {}
    for mode in (KernelMode.UNSPECIFIED, KernelMode.OFF):
        s = client.load_model("tiny-llama-4bit", kernels=mode)
        assert s.facts.device.startswith("cuda")
        assert s.facts.kernels_enabled is (mode is KernelMode.UNSPECIFIED), s.facts.kernels_reason
        s = client.attach_lora(s.session_id, FAST_LORA)
        if mode is KernelMode.UNSPECIFIED:
            assert "patched" in s.facts.kernels_reason, s.facts.kernels_reason
        events = list(client.train(s.session_id, sft_dataset.dataset_id, sft_config(60, batch_size=4)))
        assert events[-1].state.state is JobState.SUCCEEDED
        answer = client.generate(s.session_id, QUESTION, max_new_tokens=24, apply_chat_template=True)[0]
        pref = client.upload_dataset(dpo_rows())
        dpo = list(
            client.train(
                s.session_id,
                pref.dataset_id,
                TrainConfig(
                    method=TrainMethod.DPO,
                    learning_rate=5e-4,
                    max_steps=4,
                    batch_size=6,
                    lr_scheduler="constant",
                ),
            )
        )
        assert dpo[-1].state.state is JobState.SUCCEEDED, dpo[-1].state.message
        runs[mode] = (_losses(events), answer, [e.step.dpo.reward_margin for e in dpo if e.step])
        client.close_session(s.session_id)
    patched, reference = runs[KernelMode.UNSPECIFIED], runs[KernelMode.OFF]
    assert patched[1].strip() == ANSWER and reference[1].strip() == ANSWER
    # bf16 autocast on both paths: the first steps agree to bf16 noise (DESIGN: ≈1e-2 relative).
    for a, b in zip(patched[0][:5], reference[0][:5], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (patched[0][:5], reference[0][:5])
    assert patched[2][-1] > patched[2][0], "DPO on the kernel path raises the margin"


@pytest.mark.parametrize("memory_mode", [MemoryMode.MAX_SPEED, MemoryMode.LONG_CONTEXT])
def test_memory_modes_train_the_same_thing_on_cuda(client, sft_dataset, memory_mode):
    s = client.attach_lora(client.load_model("tiny-llama-4bit").session_id, FAST_LORA)
    standard = list(client.train(s.session_id, sft_dataset.dataset_id, sft_config(5, batch_size=4)))
    client.close_session(s.session_id)
    s = client.attach_lora(client.load_model("tiny-llama-4bit").session_id, FAST_LORA)
    extra = {"memory_budget_gib": 20.0} if memory_mode is MemoryMode.MAX_SPEED else {}
    events = list(
        client.train(
            s.session_id,
            sft_dataset.dataset_id,
            sft_config(5, batch_size=4, memory_mode=memory_mode, **extra),
        )
    )
    client.close_session(s.session_id)
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
    for a, b in zip(_losses(events), _losses(standard), strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (_losses(events), _losses(standard))


@pytest.mark.parametrize(
    "retention", [Retention.NONE, Retention.UNSPECIFIED], ids=["rows-alone", "chat-recipe"]
)
def test_step_graphs_replay_sft_steps_through_the_service_and_train_the_same(
    client, sft_dataset, monkeypatch, caplog, retention
):
    """MAX_SPEED with ``step_graphs`` set (no mode sets it yet): the service's SFT job replays its micro-steps as
    CUDA graphs once captured (no layer of the tiny model recomputes within the budget, so nothing reads the RNG
    state) and trains what the same job does eagerly, to bf16 noise; with the chat data's default recipe, its KL
    term runs after each replay, eagerly."""
    import dataclasses
    import logging

    from strop.common.memory_modes import MEMORY_MODES

    def run():
        s = client.attach_lora(client.load_model("tiny-llama-4bit").session_id, FAST_LORA)
        config = sft_config(
            12,
            batch_size=4,
            memory_mode=MemoryMode.MAX_SPEED,
            memory_budget_gib=20.0,
            retention=retention,
        )
        events = list(client.train(s.session_id, sft_dataset.dataset_id, config))
        client.close_session(s.session_id)
        assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
        return _losses(events)

    eager = run()
    features = dataclasses.replace(MEMORY_MODES[MemoryMode.MAX_SPEED], step_graphs=True)
    monkeypatch.setitem(MEMORY_MODES, MemoryMode.MAX_SPEED, features)
    with caplog.at_level(logging.INFO, logger="strop"):
        graphed = run()
    said = [r.getMessage() for r in caplog.records]
    about = [m for m in said if "graph" in m or "memory mode" in m]  # what the job said of its step graphs
    assert any("captured a training step as a CUDA graph" in m for m in said), about
    assert not any("step graphs: HF's training step runs" in m or "capture failed" in m for m in said), about
    for a, b in zip(graphed, eager, strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (graphed, eager)


def test_the_chat_recipes_kl_term_runs_strops_kernels_under_the_jobs_bf16(client, sft_dataset, caplog):
    """A chat SFT job's default retention adds the KL term, whose forward calls the decoder itself: it runs under
    the job's bf16 autocast, as the model's own forward, so strop's kernels serve it (without autocast PEFT's fp32
    LoRA term sends every layer to the reference path, which says so)."""
    import logging

    s = client.attach_lora(client.load_model("tiny-llama-4bit").session_id, FAST_LORA)
    with caplog.at_level(logging.INFO, logger="strop"):
        events = list(client.train(s.session_id, sft_dataset.dataset_id, sft_config(4, batch_size=4)))
    client.close_session(s.session_id)
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
    said = [r.getMessage() for r in caplog.records]
    assert any("retention KL term" in m for m in said), "the chat data's default recipe adds the KL term"
    fallbacks = [m for m in said if "reference path" in m]
    assert not fallbacks, fallbacks[:3]


def test_generate_on_a_bf16_session_runs_strops_kernels_under_the_jobs_autocast(client, caplog):
    """Generate computes under the autocast the session's jobs train in (``LoadedModel.compute_autocast``): with an
    adapter attached (fp32 factors over the bf16/4-bit base) strop's kernels serve every layer, as in training;
    without autocast PEFT's fp32 LoRA term sends each layer to the reference path, which says so."""
    import logging

    s = client.attach_lora(client.load_model("tiny-llama-4bit").session_id, FAST_LORA)
    with caplog.at_level(logging.INFO, logger="strop"):
        out = client.generate(s.session_id, QUESTION, max_new_tokens=8, apply_chat_template=True)
    client.close_session(s.session_id)
    assert len(out) == 1
    fallbacks = [r.getMessage() for r in caplog.records if "reference path" in r.getMessage()]
    assert not fallbacks, fallbacks[:3]


def test_unrounded_logits_on_cuda_are_the_fp32_sum_of_the_bf16_products():
    """The CUDA head (``torch.mm`` with an fp32 output) sums the bf16-rounded input times the bf16 weight in fp32 and
    keeps the sum: against the same products summed in fp32 by torch (summation order: a few fp32 ulps of the
    terms' magnitude), and the bf16 tie of two tokens 1/32 nat apart at a logit of 16 broken toward the higher."""
    import torch

    from strop.trainer_svc.core import generation

    class Head(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda")
            self.lm_head.to(torch.bfloat16).weight.data.copy_(weight)

        def get_output_embeddings(self):
            return self.lm_head

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(50_000, 576, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(3, 7, 576, device="cuda", generator=g)
    m = Head(w)
    with torch.autocast("cuda", dtype=torch.bfloat16), generation.unrounded_logits(m):
        got = m.lm_head(x)
    ref = x.to(torch.bfloat16).double() @ w.double().t()
    bound = 576 * 2**-23 * (x.to(torch.bfloat16).double().abs() @ w.double().abs().t())
    assert got.dtype == torch.float32 and got.shape == (3, 7, 50_000)
    assert bool(((got.double() - ref).abs() <= bound).all())
    tie = Head(torch.tensor([[16.0, 0.0], [16.0, 2**-5]]))
    one = torch.ones(1, 2, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        rounded = tie.lm_head(one)
        with generation.unrounded_logits(tie):
            exact = tie.lm_head(one)
    assert rounded[0].tolist() == [16.0, 16.0] and exact[0].tolist() == [16.0, 16.03125]
