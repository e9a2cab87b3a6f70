"""A session's forwards outside training (Generate, the retention's teacher-forced scoring) compute under the
autocast its jobs train in (``LoadedModel.compute_autocast``), so they score the model as trained, not PEFT's
fp32-LoRA arithmetic over the 16-bit base, with the output head's logits left in fp32
(``generation.unrounded_logits``). Checked on a bf16 CPU session against the same forwards written out under
torch's autocast with the head's products summed in fp32 by hand, and against the forwards without autocast or
with the head's logits rounded to bf16, which differ (so the checks can fail)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from strop.common.trainer_types import LoadModelRequest, LoraConfig, TrainConfig, TrainMethod
from strop.kernels.ops import unrounded_linear
from strop.trainer_svc.core import generation, job_config, model_loading, retention, training
from strop.trainer_svc.core.loaded_model import LoadedModel

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} and {i + 1}?"},
            {"role": "assistant", "content": f"It is {2 * i + 1}, said twice: {2 * i + 1}."},
        ]
    }
    for i in range(3)
]


@pytest.mark.parametrize(
    ("compute", "device", "autocast"),
    [
        ("bfloat16", "cpu", "bfloat16"),
        ("bfloat16", "cuda:0", "bfloat16"),
        ("float16", "cuda:1", "float16"),
        ("float16", "cpu", None),  # as the training arguments: fp16 mixed precision on CUDA only
        ("float32", "cuda:0", None),
        ("float32", "cpu", None),
    ],
)
def test_the_autocast_is_the_one_the_training_arguments_ask(compute, device, autocast):
    facts = type("Facts", (), {"compute_dtype": compute})()
    loaded = LoadedModel(None, None, facts, None, "m", device)
    assert loaded.autocast_dtype() == autocast
    cfg = job_config.with_defaults(TrainConfig(method=TrainMethod.SFT), session_max_len=64)
    args = training._training_args(cfg, loaded, Path("/tmp/w"))
    assert (args["bf16"], args["fp16"]) == (autocast == "bfloat16", autocast == "float16")
    ctx = loaded.compute_autocast()
    if autocast is None:
        assert isinstance(ctx, contextlib.nullcontext)
    else:
        assert (ctx.device, ctx.fast_dtype) == (device.split(":")[0], getattr(torch, autocast))


@pytest.fixture(scope="module")
def bf16_session(model_root):
    """The tiny Llama as a bf16 CPU session with an adapter whose B factors are not zero (PEFT's init leaves the
    model the base): fp32 factors over a bf16 base, as every 16-bit session holds them."""
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama", dtype="bfloat16"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=16, seed=0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    assert {p.dtype for n, p in loaded.model.named_parameters() if "lora_" in n} == {torch.float32}
    return loaded


@contextlib.contextmanager
def _as_inference(model, *, round_head: bool = False):
    """bf16 autocast, the output head's logits the bf16-rounded input times the weight summed and kept in fp32 (a
    hook), or with ``round_head`` rounded to bf16 at the end as the plain autocast forward gives them."""
    head = model.get_output_embeddings()

    def exact(m, args, out):
        with torch.autocast("cpu", enabled=False):  # the hook runs inside the forward's autocast
            logits = args[0].to(m.weight.dtype).float() @ m.weight.float().t()
        return logits.to(torch.bfloat16) if round_head else logits

    hook = head.register_forward_hook(exact)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        hook.remove()


def _hits_by_hand(loaded, ctx) -> list[float]:
    """Each conversation's summed NLL over its assistant tokens, the plain forward under ``ctx``."""
    out = []
    model = loaded.model
    model.eval()
    try:
        for conv in ROWS:
            row = job_config.assistant_masked(conv["messages"], loaded.tokenizer)
            ids = torch.tensor([row["input_ids"]])
            mask = torch.tensor(row["completion_mask"][1:], dtype=torch.bool)
            with torch.no_grad(), ctx():
                logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(
                float(torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"))
            )
    finally:
        model.train()
    return out


def test_teacher_forced_scoring_computes_as_the_jobs_train(bf16_session):
    model = bf16_session.model
    got = [h[0][2] for h in retention.conversation_hits(bf16_session, ROWS)]
    trained = _hits_by_hand(bf16_session, lambda: _as_inference(model))
    plain = _hits_by_hand(bf16_session, contextlib.nullcontext)
    rounded = _hits_by_hand(bf16_session, lambda: _as_inference(model, round_head=True))
    # the turns' tokens as the scorer cuts them (at the end of turn) are the ones summed by hand: each row ends its
    # answer with the turn, so the two agree exactly where the arithmetic is the same
    assert got == pytest.approx(trained, rel=1e-6, abs=1e-5)
    assert plain != pytest.approx(trained, rel=1e-6, abs=1e-5), "without autocast the scores differ"
    assert rounded != pytest.approx(trained, rel=1e-6, abs=1e-5), "with bf16 logits the scores differ"


def test_generate_decodes_as_the_jobs_train(bf16_session):
    prompt = "What is 2 and 3?"
    tok, model = bf16_session.tokenizer, bf16_session.model
    seen: list[tuple[bool, torch.dtype]] = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda m, a: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )
    try:
        (got,) = generation.generate(
            bf16_session, [prompt], max_new_tokens=12, disable_adapter=False, apply_chat_template=False
        )
        answers, finished = generation.generate_chat_batch(
            bf16_session, [prompt, "And 4 and 5?"], max_new_tokens=4, disable_adapter=True
        )
    finally:
        hook.remove()
    assert len(answers) == len(finished) == 2
    assert len(seen) >= 12 and set(seen) == {(True, torch.bfloat16)}, (
        "every decoding step under the jobs' autocast"
    )
    enc = tok(prompt, return_tensors="pt")
    model.eval()
    try:
        with torch.no_grad(), _as_inference(model):
            ref = model.generate(
                **enc, max_new_tokens=12, do_sample=False, num_beams=1, pad_token_id=tok.pad_token_id
            )
    finally:
        model.train()
    assert got == tok.decode(ref[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_unrounded_logits_break_a_bf16_tie_as_the_head_computes_it(monkeypatch):
    """Two tokens 1/32 nat apart at a logit of 16 tie once rounded to bf16 (its step there is 1/8), and greedy
    decoding would take the lower id; unrounded, the higher one wins: with an fp32 weight under autocast (rounded to
    bf16 as autocast rounds it), with a 16-bit weight through the CPU's sliced path, whose slices are joined in
    vocabulary order, and through a CPU session's fp32 copy of the weight."""

    class Head(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.lm_head = torch.nn.Linear(2, 5, bias=False, dtype=dtype)
            with torch.no_grad():
                self.lm_head.weight.copy_(
                    torch.tensor([[0.0, 1.0], [16.0, 0.0], [16.0, 2**-5], [1.0, 0.0], [0.0, -1.0]])
                )

        def get_output_embeddings(self):
            return self.lm_head

    monkeypatch.setattr(unrounded_linear, "CPU_ROWS", 2)  # three slices
    x = torch.tensor([[[1.0, 1.0]]], dtype=torch.bfloat16)
    for dtype, copy in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        m = Head(dtype)
        weight32 = m.lm_head.weight.float() if copy else None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded = m.lm_head(x)
            with generation.unrounded_logits(m, weight32):
                exact = m.lm_head(x)
        assert rounded.dtype == torch.bfloat16 and float(rounded[0, 0, 1]) == float(rounded[0, 0, 2]) == 16.0
        assert exact.dtype == torch.float32 and exact.shape == (1, 1, 5)
        assert exact[0, 0].tolist() == [1.0, 16.0, 16.03125, 1.0, -1.0]
        assert (int(rounded.argmax()), int(exact.argmax())) == (1, 2)
        assert "forward" not in m.lm_head.__dict__, "the head's own forward is back"


def test_a_bf16_cpu_sessions_head_decides_from_its_fp32_copy(bf16_session):
    """A bf16 CPU session generates through ``inference`` with its output head's weight copied to fp32 once (the CPU
    has no fp32-output 16-bit GEMM; converting the weight at every decoding step costs more than the product): the
    logits are those of the path that converts it each call, the copy is what the head multiplies (a changed copy
    changes the logits), it is made again when the weight changes, and a job's start drops it."""
    model = bf16_session.model
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    generation.drop_inference_weights(bf16_session)
    with generation.inference(bf16_session) as m:
        got = m(input_ids=ids).logits
    key, copy = bf16_session.extra[generation.INFERENCE_HEAD]
    weight = model.get_output_embeddings().weight
    assert copy.dtype == torch.float32 and torch.equal(copy, weight.float())
    model.eval()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), generation.unrounded_logits(model):
            converted = model(input_ids=ids).logits
    finally:
        model.train()
    assert got.dtype == converted.dtype == torch.float32
    torch.testing.assert_close(got, converted, rtol=0, atol=0)
    copy.mul_(2)  # the head multiplies the copy
    with generation.inference(bf16_session) as m:
        assert not torch.equal(m(input_ids=ids).logits, got)
    with torch.no_grad():
        weight.add_(0)  # a new version of the weight: the copy is made again from it
    with generation.inference(bf16_session) as m:
        torch.testing.assert_close(m(input_ids=ids).logits, got, rtol=0, atol=0)
    assert bf16_session.extra[generation.INFERENCE_HEAD][0] != key
    generation.drop_inference_weights(bf16_session)
    assert generation.INFERENCE_HEAD not in bf16_session.extra
