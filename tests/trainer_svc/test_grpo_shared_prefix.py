"""GRPO's shared-prefix layout (``trainer_svc/core/shared_prefix.py``): a group trained as one row with its prompt
once gives the hidden states, log-probs and LoRA gradients of the padded rows (the prompt once per sample).

Bounds. Everything is fp32 on the CPU; the two layouts run the same products over the same keys in different
shapes (one causal SDPA over the prompt and the first completion plus a masked one for the later completions,
against one causal SDPA per padded row), so they differ by fp32 rounding: each of the ~10 matmul/softmax stages of the 2-layer model adds a relative
error of ~sqrt(K)·2^-24 (K ≤ 512, ≈ 1.4e-6), i.e. ~1e-5 relative on hidden states of norm ~16 (RMS-normalised), so
an absolute 1e-4 on the hidden rows and log-probs; gradients sum that over the positions, compared relative to the
largest entry at 1e-4. A layout that mixed samples (a completion seeing another's tokens) or shifted a position
would move the log-probs by ~0.1-1 nats (a random LoRA with B ≠ 0 changes every logit), far outside those bounds.
"""

from __future__ import annotations

import types

import pytest
import torch

from strop.kernels.losses.logps import token_logps_reference
from strop.trainer_svc.core import grpo, shared_prefix
from strop.trainer_svc.core.sampler import SampledSequence

TOL = 1e-4  # see the module docstring


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (fp32, 4 query / 2 kv heads) with a LoRA adapter whose B is not zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("shared") / "tiny", arch="llama", dtype="float32", seed=0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    return get_peft_model(base, cfg)


PROMPT = [5, 17, 42, 99, 7, 300, 12, 8]
# ragged: one token (predicted from the prompt alone), a few, and the longest
COMPLETIONS = [[61], [70, 71, 72], [80, 81, 82, 83, 84, 85], [90, 91]]


def _run(model, shared: bool, checkpointing: bool):
    """(log-probs of every completion token, LoRA gradients of their sum weighted per token) in one layout."""
    seqs = [SampledSequence(c, [0.0] * len(c), "length") for c in COMPLETIONS]
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    grp = grpo._group(PROMPT, seqs, adv, "cpu", shared)
    loop = types.SimpleNamespace(loaded=types.SimpleNamespace(model=model))
    model.zero_grad(set_to_none=True)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with grpo.GrpoLoop._layout(loop, grp):
            rows = grpo.GrpoLoop._rows(loop, grp)
            head = model.get_base_model().lm_head.weight
            lp = token_logps_reference(rows, head, grp.targets)
            # a per-token weight, so each position's gradient counts with its own sign and size
            (lp * grp.inputs["advantages"]).sum().backward()
    finally:
        if checkpointing:
            model.gradient_checkpointing_disable()
        model.train(False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return rows.detach(), lp.detach(), grads, grp


@pytest.mark.parametrize(
    ("checkpointing", "buckets"),
    # buckets: the attention's lengths rounded up as on CUDA with cuDNN (shared_prompt.BUCKETS), through the
    # checkpointed recompute too
    [(False, None), (True, None), (True, True)],
)
def test_one_row_with_the_prompt_once_equals_the_padded_rows(tiny, checkpointing, buckets, monkeypatch):
    from strop.kernels.trainers import shared_prompt

    monkeypatch.setattr(shared_prompt, "BUCKETS", buckets)
    assert shared_prefix.reason(tiny) is None  # a Llama: the job trains its groups this way
    rows_p, lp_p, grads_p, padded = _run(tiny, shared=False, checkpointing=checkpointing)
    rows_s, lp_s, grads_s, grp = _run(tiny, shared=True, checkpointing=checkpointing)
    # the row: the prompt once and each completion minus its last token; 15 positions against 4 x 13 padded
    assert grp.batch.tokens.shape == (1, len(PROMPT) + sum(len(c) - 1 for c in COMPLETIONS))
    assert padded.batch.tokens.shape == (4, len(PROMPT) + max(len(c) for c in COMPLETIONS) - 1)
    assert grp.tokens == padded.tokens == 4 * len(PROMPT) + sum(len(c) for c in COMPLETIONS)
    assert torch.equal(grp.targets, padded.targets)
    assert rows_s.shape == rows_p.shape == (sum(len(c) for c in COMPLETIONS), tiny.config.hidden_size)
    assert (rows_s - rows_p).abs().max() < TOL
    assert (lp_s - lp_p).abs().max() < TOL
    assert lp_p.abs().min() > 1.0  # the log-probs compared are several nats, not ~0 (a random 640-token head)
    assert grads_s.keys() == grads_p.keys() and len(grads_p) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, g in grads_p.items():
        scale = g.abs().max()
        assert scale > 0, name
        assert (grads_s[name] - g).abs().max() <= TOL * scale, name
    # the configs are put back: the model's own attention, no layout left on them
    assert tiny.config._attn_implementation == "sdpa"
    assert not hasattr(tiny.config, "_strop_shared_prefix")


def test_the_layouts_agree_through_strops_patched_forwards(tiny, monkeypatch):
    """As a CUDA session trains (strop's kernels patched, layers checkpointed; here through the Triton interpreter):
    the patched attention forward hands the row to the shared-prefix attention, and both layouts agree as above."""
    import strop.kernels.models.patched_forwards as pf
    from strop.kernels.models import patch_model, unpatch_model

    calls = []
    qkv = pf.lora_qkv
    monkeypatch.setattr(pf, "lora_qkv", lambda *a, **k: calls.append(1) or qkv(*a, **k))
    patch_model(tiny)
    try:
        _, lp_p, grads_p, _ = _run(tiny, shared=False, checkpointing=True)
        _, lp_s, grads_s, _ = _run(tiny, shared=True, checkpointing=True)
    finally:
        unpatch_model(tiny)
    assert len(calls) == 8  # 2 layers x (forward + recompute) x 2 layouts: strop's fused Q/K/V ran
    assert (lp_s - lp_p).abs().max() < TOL
    for name, g in grads_p.items():
        assert (grads_s[name] - g).abs().max() <= TOL * g.abs().max(), name


def test_a_completion_sees_the_prompt_and_its_own_tokens_only():
    lay = shared_prefix.layout(3, [2, 0, 1])
    assert lay.width == 6
    # sample 0 attends causally with the prompt (is_causal over the first 5 positions); the later samples' queries,
    # here sample 2's one, see the 3 prompt keys, none of sample 0's 2, and their own
    assert torch.equal(lay.later_mask("cpu")[0, 0], torch.tensor([[1, 1, 1, 0, 0, 1]], dtype=torch.bool))
    # two later samples of 2 and 1 inputs after a first of 1: each sees the prompt and its own earlier tokens only
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 0, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(shared_prefix.layout(3, [1, 2, 1]).later_mask("cpu")[0, 0], expected)
    rows = shared_prefix.predicting_rows(lay, [3, 1, 2], "cpu")
    # sample 0: the prompt's last position, then its inputs 3, 4; sample 1: the prompt's last; sample 2: it and 5
    assert rows.tolist() == [2, 3, 4, 2, 2, 5]


def test_sliding_window_attention_trains_padded_rows(tmp_path):
    from transformers import AutoModelForCausalLM

    from strop.fixtures import make_tiny_model

    path = make_tiny_model(tmp_path / "gemma", arch="gemma3_text", dtype="float32", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert shared_prefix.reason(model) == "sliding-window attention"
