"""A session's forwards outside training (Generate, the retention's teacher-forced scoring) compute under the
autocast its jobs train in (``LoadedModel.compute_autocast``), so they score the model as trained, not PEFT's
fp32-LoRA arithmetic over the 16-bit base. Checked on a bf16 CPU session against the same forwards written out
under torch's autocast, and against the forwards without it, which differ (so the checks can fail)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from strop.common.trainer_types import LoadModelRequest, LoraConfig, TrainConfig, TrainMethod
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
    got = [h[0][2] for h in retention.conversation_hits(bf16_session, ROWS)]
    trained = _hits_by_hand(bf16_session, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    plain = _hits_by_hand(bf16_session, contextlib.nullcontext)
    # the turns' tokens as the scorer cuts them (at the end of turn) are the ones summed by hand: each row ends its
    # answer with the turn, so the two agree exactly where the arithmetic is the same
    assert got == pytest.approx(trained, rel=1e-6, abs=1e-5)
    assert plain != pytest.approx(trained, rel=1e-6, abs=1e-5), "without autocast the scores differ"


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
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model.generate(
                **enc, max_new_tokens=12, do_sample=False, num_beams=1, pad_token_id=tok.pad_token_id
            )
    finally:
        model.train()
    assert got == tok.decode(ref[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
