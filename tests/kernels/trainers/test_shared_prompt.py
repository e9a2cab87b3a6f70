"""Preference pairs sharing their prompt (``kernels/trainers/shared_prompt.py``): the shared batch's hidden states,
gathered back, are the unshared batch's, and so are the gradients of a loss on them (attention over the shared
rows by ``attend`` through the wrapped SDPA function: prompt + chosen causal, rejected over [prompt | rejected]).

Reference: the same tiny fp32 Llama (HF's sdpa attention, and strop's patched kernels under TRITON_INTERPRET=1)
run on TRL's ``[chosen; rejected]`` rows. Bound: fp32 rounding of a 2-layer, 64-wide model whose GEMMs and
attention change shape (the rejected completion's attention runs with a lower-right mask over other key runs):
observed ≈1e-6 absolute on O(1) states; 1e-4 leaves room for other CPUs' reduction orders and stays far under a
wrong mask's error (a chosen token visible to a rejected one moves states by O(0.1)).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from strop.kernels.trainers import shared_prompt
from strop.kernels.trainers.shared_prompt import Rows, share_prompts
from tests.kernels._chunked_losses import tiny_peft_llama, tiny_tokenizer

ATOL = 1e-4


def _batch(prompts=(5, 9, 3), chosen=(4, 6, 2), rejected=(7, 1, 5), seed=0, vocab=300):
    """TRL's collation of three pairs: rows [prompt + chosen] then [prompt + rejected], right-padded."""
    gen = torch.Generator().manual_seed(seed)
    rows, comp = [], []
    prompt_ids = [torch.randint(3, vocab, (p,), generator=gen) for p in prompts]
    for answers in (chosen, rejected):
        for p_ids, c in zip(prompt_ids, answers, strict=True):
            rows.append(torch.cat([p_ids, torch.randint(3, vocab, (c,), generator=gen)]))
            comp.append([0] * len(p_ids) + [1] * c)
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    am = torch.zeros_like(ids)
    cm = torch.zeros_like(ids)
    for i, (r, c) in enumerate(zip(rows, comp, strict=True)):
        ids[i, : len(r)], am[i, : len(r)], cm[i, : len(r)] = r, 1, torch.tensor(c)
    return ids, am, cm


def _model(attn: str, patched: bool):
    model = tiny_peft_llama(tiny_tokenizer())
    hf = model.get_base_model()
    hf.config._attn_implementation = attn
    if patched:
        from strop.kernels.models import patch_model

        patch_model(model)
    for name, p in model.named_parameters():  # a non-zero adapter, so its gradients are not trivially equal
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    return model


def _hidden_and_grads(model, kwargs, unshare, weights, valid):
    model.zero_grad()
    hidden = unshare(model.get_base_model().model(**kwargs).last_hidden_state)
    (hidden[valid] * weights[valid]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return hidden.detach(), grads


@pytest.mark.parametrize(
    ("pairs", "patched", "packed"),
    [
        # 3 pairs of widths 9+7 / 15+10 / 5+8 (padded to 15) run as widths 16 / 16 / 10 (padded to 16): each pair
        # of its own lengths, so attention runs pair by pair
        (((5, 9, 3), (4, 6, 2), (7, 1, 5)), False, False),
        (((5, 9, 3), (4, 6, 2), (7, 1, 5)), True, False),
        # the DPO bench's shape in small: every pair alike, so attention runs the batch in one call each way
        (((6, 6, 6), (5, 5, 5), (5, 5, 5)), False, False),
        # packed sequences (one variable-length call; here its fp32 math, the kernel's on CUDA)
        (((5, 9, 3), (4, 6, 2), (7, 1, 5)), True, True),
        (((6, 6, 6), (5, 5, 5), (5, 5, 5)), False, True),
    ],
)
def test_shared_prompts_give_the_unshared_hidden_states_and_gradients(pairs, patched, packed, monkeypatch):
    monkeypatch.setattr(shared_prompt, "VARLEN", packed)
    prompts, chosen, rejected = pairs
    ids, am, cm = _batch(prompts, chosen, rejected)
    model = _model("sdpa", patched)
    shared = share_prompts(ids, am, cm, attn_implementation="sdpa")
    assert not isinstance(shared, str), shared
    calls = []
    real = shared_prompt.attend
    monkeypatch.setattr(shared_prompt, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    width = max(p + c + r for p, c, r in zip(*pairs, strict=True))
    t = max(p + max(c, r) for p, c, r in zip(*pairs, strict=True))
    assert shared.input_ids.shape == (3, width) and shared.saved == pytest.approx(1 - 3 * width / (6 * t))
    assert shared.rows.prompts == prompts and shared.rows.suffixes == tuple(
        zip(chosen, rejected, strict=True)
    )
    valid = am.bool()
    weights = torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(2))
    ref_h, ref_g = _hidden_and_grads(
        model, {"input_ids": ids, "attention_mask": am}, lambda h: h, weights, valid
    )
    h, g = _hidden_and_grads(model, shared.model_kwargs(), shared.unshare, weights, valid)
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(h[valid], ref_h[valid], rtol=0, atol=ATOL)
    assert ref_g, "the model has trainable adapters"
    for name, ref in ref_g.items():
        torch.testing.assert_close(g[name], ref, rtol=1e-4, atol=ATOL * ref.abs().max().item(), msg=name)


def test_a_mask_that_lets_rejected_tokens_see_the_chosen_ones_is_caught_by_the_bound():
    """The test's bound separates a right layout from a wrong one: the same shared batch with the chosen
    completion visible to the rejected tokens (plain causal) moves the rejected states far past it."""
    ids, am, cm = _batch()
    model = _model("sdpa", False)
    shared = share_prompts(ids, am, cm, attn_implementation="sdpa")
    causal = torch.ones_like(shared.attention_mask).tril_()
    leaky = {**shared.model_kwargs(), "attention_mask": causal}
    ref = model.get_base_model().model(input_ids=ids, attention_mask=am).last_hidden_state
    h = shared.unshare(model.get_base_model().model(**leaky).last_hidden_state)
    rejected = am.bool() & (cm.bool()) & (torch.arange(6) >= 3)[:, None]
    assert (h[rejected] - ref[rejected]).abs().max() > 100 * ATOL


def test_batches_that_cannot_share_say_why():
    ids, am, cm = _batch()
    other = ids.clone()
    other[3, 0] += 1  # pair 0's rejected row starts with another prompt
    assert "different prompt tokens" in share_prompts(other, am, cm, attn_implementation="sdpa")
    shorter = cm.clone()
    shorter[3, 4] = 1  # pair 0's rejected prompt is a token shorter
    assert "different lengths" in share_prompts(ids, am, shorter, attn_implementation="sdpa")
    left = am.flip(1)
    assert "right padding" in share_prompts(ids, left, cm, attn_implementation="sdpa")
    holes = cm.clone()
    holes[0, 6] = 0
    assert "contiguous" in share_prompts(ids, am, holes, attn_implementation="sdpa")
    assert "reached through sdpa" in share_prompts(ids, am, cm, attn_implementation="flash_attention_2")
    assert "reached through sdpa" in share_prompts(ids, am, cm, attn_implementation="eager")
    assert "not [chosen; rejected] rows" in share_prompts(ids[:5], am[:5], cm[:5], attn_implementation="sdpa")
    ids2, am2, cm2 = _batch(prompts=(1, 1, 1), chosen=(9, 9, 9), rejected=(9, 9, 9))
    assert "would save" in share_prompts(ids2, am2, cm2, attn_implementation="sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_prompts_in_bf16_stay_within_the_unshared_bf16_error():
    # CUDA, strop's kernels, bf16 autocast: attention runs on CUDA's kernels (is_causal and the lower-right bias);
    # the shared states' error against the fp32 unshared truth must stay within 2x the unshared bf16 run's
    ids, am, cm = _batch(prompts=(200, 310, 96), chosen=(150, 64, 300), rejected=(90, 250, 128))
    ids, am, cm = ids.cuda(), am.cuda(), cm.cuda()
    model = _model("sdpa", patched=False).cuda()
    from strop.kernels.models import patch_model

    patch_model(model)
    shared = share_prompts(ids, am, cm, attn_implementation="sdpa")
    assert not isinstance(shared, str), shared
    backbone = model.get_base_model().model
    valid = am.bool()
    with torch.no_grad():
        truth = backbone(input_ids=ids, attention_mask=am).last_hidden_state
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plain = backbone(input_ids=ids, attention_mask=am).last_hidden_state.float()
            ours = shared.unshare(backbone(**shared.model_kwargs()).last_hidden_state).float()
    err_plain = (plain[valid] - truth[valid]).abs().max().item()
    err_ours = (ours[valid] - truth[valid]).abs().max().item()
    print(f"bf16 error against fp32: unshared {err_plain:.3g}, shared {err_ours:.3g}")
    assert err_ours <= 2 * err_plain + 1e-6


def test_models_whose_attention_the_layout_cannot_carry_run_unshared():
    from types import SimpleNamespace

    from strop.kernels.trainers.shared_prompt import PromptSharing

    ids, am, cm = _batch()
    kwargs = {"input_ids": ids, "attention_mask": am, "use_cache": False}

    def model(**config):
        cfg = SimpleNamespace(**{"_attn_implementation": "sdpa", "sliding_window": None, **config})
        return SimpleNamespace(config=cfg, dtype=torch.float32)

    sharing = PromptSharing("DPO")
    assert sharing.layout(model(), kwargs, cm) is not None and sharing.batches == 1
    assert sharing.layout(model(sliding_window=8), kwargs, cm) is None  # Gemma's, Mistral's windows
    assert (
        sharing.layout(model(sliding_window=8, use_sliding_window=False), kwargs, cm) is not None
    )  # Qwen2's off
    assert sharing.layout(model(sliding_window=64), kwargs, cm) is not None  # wider than the rows: no effect
    split = model()
    split.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert sharing.layout(split, kwargs, cm) is None
    assert sharing.batches == 3 and len(sharing.reasons) == 2, sharing.reasons
    assert any("sliding-window" in r for r in sharing.reasons) and any(
        "split over 2" in r for r in sharing.reasons
    )


def _attend_reference(rows: Rows, q, k, v):
    """The same attention by one dense mask per row (each position's segment: 0 the prompt, s the s-th suffix,
    -1 padding): a query sees an earlier-or-same key of the prompt or of its own segment; padding outputs zero."""
    b, hq, length, _ = q.shape
    seg = torch.full((b, length), -1, device=q.device)
    for i, (p, ns) in enumerate(zip(rows.prompts, rows.suffixes, strict=True)):
        seg[i, :p] = 0
        start = p
        for s, n in enumerate(ns, 1):
            seg[i, start : start + n] = s
            start += n
    pos = torch.arange(length, device=q.device)
    sq, sk = seg[:, :, None], seg[:, None, :]
    allowed = (pos[:, None] >= pos[None, :]) & (sq >= 0) & ((sk == 0) | (sk == sq))
    allowed |= torch.eye(
        length, dtype=torch.bool, device=q.device
    )  # a padding query its own key, so its softmax is defined
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return out.masked_fill((seg < 0)[:, None, :, None], 0).transpose(1, 2)


@pytest.mark.parametrize(
    "layout",
    [
        ((4,), ((3, 5),), 12),  # a pair, padded
        ((4, 4, 2), ((3, 5), (3, 5), (6, 1)), 12),  # two pairs alike, one of its own: two groups
        ((5,), ((2, 0, 3, 1),), 11),  # a GRPO group: an empty sample, several later ones
        ((3, 6), ((4,), (0, 2)), 9),  # a prompt with one suffix; a pair whose chosen completion is empty
        ((5, 3), ((2, 0, 3, 1), (1, 4, 2)), 12),  # groups of other lengths
        ((4, 4), ((2, 3, 1), (2, 3, 1)), 10),  # groups alike, several later suffixes
        ((2, 2), ((3, 4), (3, 4)), 10),  # pairs alike: the lower-right call
    ],
)
def test_attend_is_the_dense_segment_mask_attention(layout):
    """``attend`` (no mask over the row: a causal call, then a lower-right one for pairs alike or a masked one over
    the later positions, grouped-query heads) against the dense [L, L] mask of the layout in fp32; a suffix that
    saw another's key would move its output by O(0.1) against a bound of fp32 rounding (1e-5 on O(1) outputs)."""
    rows = Rows(*layout)
    gen = torch.Generator().manual_seed(0)
    b, length = len(rows.prompts), rows.width
    q = torch.randn(b, 4, length, 8, generator=gen)
    k, v = (torch.randn(b, 2, length, 8, generator=gen) for _ in range(2))
    got = shared_prompt.attend(rows, q, k, v)
    torch.testing.assert_close(got, _attend_reference(rows, q, k, v), rtol=0, atol=1e-5)


def _real(rows: Rows, length: int) -> torch.Tensor:
    """``[B, length]``: the positions of each row that are not padding."""
    at = torch.arange(length)[None, :]
    return (
        at < torch.tensor([p + sum(ns) for p, ns in zip(rows.prompts, rows.suffixes, strict=True)])[:, None]
    )


@pytest.mark.parametrize(
    "layout",
    [
        ((4,), ((3, 5),), 12),  # a pair, padded
        ((4, 4, 2), ((3, 5), (3, 5), (6, 1)), 12),  # two pairs alike, one of its own
        ((5,), ((2, 0, 3, 1),), 11),  # a GRPO group: an empty sample, several later ones
        ((3, 6), ((4,), (0, 2)), 9),  # a prompt with one suffix; a pair whose chosen completion is empty
        ((5, 3), ((2, 0, 3, 1), (1, 4, 2)), 12),  # groups of other lengths
        ((0, 2), ((3, 4), (3, 4)), 10),  # no prompt: the later suffix over its own keys alone
    ],
)
def test_packed_attend_is_the_dense_segment_mask_attention_with_its_gradients(layout, monkeypatch):
    """The packed path (``VARLEN``: every row's sequences in one variable-length call, keys gathered, their
    gradients summed back over the sequences that read them) against the dense [L, L] mask of the layout in fp32,
    output and the gradients of q, k and v, at the real positions (a padding query attends within its row's last
    sequence; the loss weights it by zero, as no label reads it). Bound: fp32 rounding of O(1) values (1e-5); a
    prompt key whose gradient from a later suffix was dropped, or counted twice, moves it by O(0.1)."""
    monkeypatch.setattr(shared_prompt, "VARLEN", True)
    rows = Rows(*layout)
    gen = torch.Generator().manual_seed(0)
    b, length = len(rows.prompts), rows.width
    q = torch.randn(b, 4, length, 8, generator=gen)
    k, v = (torch.randn(b, 2, length, 8, generator=gen) for _ in range(2))
    real = _real(rows, length)
    weights = torch.randn(b, length, 4, 8, generator=gen) * real[:, :, None, None]
    grads = []
    for fn in (shared_prompt.attend, _attend_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(rows, *leaves)
        (out * weights).sum().backward()
        grads.append((out.detach()[real], [t.grad for t in leaves]))
    (got, got_grads), (want, want_grads) = grads
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=name)


def test_the_packing_reads_each_prompt_key_once_per_sequence_and_every_row_once_first():
    """The plan of a pair and a GRPO group: queries in row order, each later suffix's keys its prompt's and then its
    own, the padding on the row's last sequence; every row read first exactly once, and each further reading in a
    group of distinct rows (so one ``index_add_`` a group adds each row once)."""
    rows = Rows((2, 3), ((1, 2), (1, 0, 2)), 7)
    plan = rows.packing(7, "cpu")
    # row 0: [p p c r r | pad pad]; row 1: [p p p c | s3 s3 | pad]
    assert plan.cu_q.tolist() == [0, 3, 7, 11, 14]
    assert plan.lengths == ((3, 3), (4, 6), (4, 4), (3, 6))
    row0 = [[0, 1, 2], [0, 1, 3, 4, 5, 6]]  # p p c; then p p r r pad pad
    row1 = [[7, 8, 9, 10], [7, 8, 9, 11, 12, 13]]  # p p p c; then p p p s3 s3 pad
    assert plan.k_index.tolist() == [i for keys in row0 + row1 for i in keys]
    assert plan.k_index[plan.first].tolist() == list(range(14))
    ((again_rows, again_at),) = plan.extra
    assert again_rows.tolist() == [0, 1, 7, 8, 9]
    assert plan.k_index[again_at].tolist() == again_rows.tolist()
    assert rows.packed_keys(7) == 7 + 2 + 7 + 3  # each prompt once more for its one non-empty later suffix


def test_packed_attend_runs_only_where_the_gathered_keys_stay_small(monkeypatch):
    """Unset, ``VARLEN`` packs only on the flash kernels (not this CPU's fp32), rows up to PACKED_MAX_ROW, and only
    where the keys gathered stay within PACKED_KEYS_MAX of the rows: a pair (1.5×) would, a long prompt's group of
    eight would not (8 copies)."""
    calls: list[int] = []
    monkeypatch.setattr(shared_prompt, "packed_attention", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(shared_prompt, "VARLEN", None)
    rows = Rows((4,), ((2, 2),), 8)
    q = torch.randn(1, 2, 8, 8)
    shared_prompt.attend(rows, q, q, q)
    assert calls == []  # fp32 on the CPU: the SDPA calls
    monkeypatch.setattr(shared_prompt, "flash_takes", lambda q, k, v: True)
    assert shared_prompt._packed(rows, q, q, q)
    group = Rows((64,), ((1,) * 8,), 72)
    long_q = torch.randn(1, 2, 72, 8)
    assert group.packed_keys(72) == 72 + 64 * 7 > 2 * 72
    assert not shared_prompt._packed(group, long_q, long_q, long_q)
    assert shared_prompt._packed(Rows((64,), ((1, 1),), 72), long_q, long_q, long_q)  # one copy: 1.9x the row
    monkeypatch.setattr(shared_prompt, "PACKED_MAX_ROW", 7)  # a row longer than it keeps the SDPA calls
    assert not shared_prompt._packed(rows, q, q, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "layout",
    [
        ((512, 512, 512, 512), ((512, 512),) * 4, 1536),  # the DPO bench's pairs
        ((1024, 1024), ((1024, 768), (512, 1500)), 3072),  # pairs of other lengths, padded
        ((300,), ((90, 0, 130, 200, 264),), 984),  # a GRPO group whose prompt's copies stay within 2x the row
    ],
)
def test_gpu_packed_attend_in_bf16_is_within_the_sdpa_paths_error_in_output_and_gradients(
    layout, monkeypatch
):
    """An 8B model's heads (32 query, 8 kv, 128 wide) on FlashAttention-2's variable-length kernels (grouped-query
    heads unrepeated, bottom-right causal for the later suffixes) against the dense-mask attention in fp32: the
    output and q, k, v's gradients at the real positions within 2× the error of the SDPA calls' path in bf16 on the
    same inputs (plus 1e-3 of the largest value), far under a wrong key set's O(0.1) and a NaN."""
    rows = Rows(*layout)
    b, length = len(rows.prompts), rows.width
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 32, length, 128, device="cuda", generator=gen)
    k, v = (torch.randn(b, 8, length, 128, device="cuda", generator=gen) for _ in range(2))
    real = _real(rows, length).cuda()
    weights = torch.randn(b, length, 32, 128, device="cuda", generator=gen) * real[:, :, None, None]

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(rows, *leaves)
        (out.float() * weights).sum().backward()
        return [out.detach().float()[real]] + [t.grad.float() for t in leaves]

    truth = run(_attend_reference, torch.float32)
    monkeypatch.setattr(shared_prompt, "VARLEN", False)
    sdpa = run(shared_prompt.attend, torch.bfloat16)
    monkeypatch.setattr(shared_prompt, "VARLEN", None)  # what a bf16 job gets: the packed call
    assert shared_prompt._packed(rows, q.bfloat16(), k.bfloat16(), v.bfloat16())
    packed = run(shared_prompt.attend, torch.bfloat16)
    for name, t, s, p in zip(("o", "dq", "dk", "dv"), truth, sdpa, packed, strict=True):
        err_s, err_p = (s - t).abs().max().item(), (p - t).abs().max().item()
        print(f"{name}: bf16 error, SDPA calls {err_s:.3g}, packed {err_p:.3g}")
        assert err_p <= 2 * err_s + 1e-3 * t.abs().max().item(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "layout",
    [
        ((1024, 1024), ((1024, 768), (1024, 768)), 3072),  # pairs alike: causal + lower-right (flash)
        ((1024, 1024), ((1024, 768), (512, 1500)), 3072),  # pairs of other lengths: causal + masked
    ],
)
def test_gpu_attend_in_bf16_at_an_8b_heads_shape_matches_the_dense_mask(layout, monkeypatch):
    """An 8B model's heads (32 query, 8 kv, 128 wide): ``attend`` in bf16 on CUDA's kernels (flash for the causal
    and the lower-right calls, grouped-query heads unrepeated; the masked call's kernel) against the dense-mask
    attention in fp32. Bound: bf16 inputs' rounding (2^-9 relative) through a softmax-weighted mean of O(1)
    values: 2e-2 absolute, far under a wrong key set's O(0.1) and a NaN."""
    monkeypatch.setattr(shared_prompt, "VARLEN", False)  # the SDPA calls (the packed path: the test above)
    rows = Rows(*layout)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 3072, 128, device="cuda", generator=gen)
    k, v = (torch.randn(2, 8, 3072, 128, device="cuda", generator=gen) for _ in range(2))
    truth = _attend_reference(rows, q, k, v)
    got = shared_prompt.attend(rows, *(t.bfloat16() for t in (q, k, v))).float()
    torch.testing.assert_close(got, truth, rtol=0, atol=2e-2)
    # fp32, which flash does not take: the lower-right call repeats the kv heads for the memory-efficient kernel
    torch.testing.assert_close(shared_prompt.attend(rows, q, k, v), truth, rtol=0, atol=1e-3)


def _sdpa_recorder(monkeypatch) -> list[tuple]:
    """Each SDPA call's (q, k, v, mask) shapes and strides, as torch keys a cuDNN graph by them."""
    calls: list[tuple] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kwargs):
        mask = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.stride())
        calls.append((*((tuple(t.shape), t.stride()) for t in (q, k, v)), mask))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    return calls


@pytest.mark.parametrize(
    "layout",
    [
        ((5,), ((2, 0, 3, 1),), 11),  # a GRPO group
        ((37,), ((9, 4, 12, 7),), 69),  # a GRPO group whose lengths are no bucket's
        ((5, 3), ((2, 0, 3, 1), (1, 4, 2)), 12),  # groups of other lengths
        ((3, 6), ((4,), (0, 2)), 9),  # a pair whose chosen completion is empty
        ((2, 2), ((3, 4), (3, 4)), 10),  # pairs alike: the lower-right call
    ],
)
def test_attend_in_length_buckets_is_attend_unpadded_with_the_same_gradients(layout, monkeypatch):
    """Lengths rounded up to a bucket (zeros past the real positions; the padded keys after every causal query or
    masked out, the padded queries dropped) change neither the output nor any gradient: fp32 against the unpadded
    calls and the dense reference, bound fp32 rounding of O(1) values (1e-5; a padded key that a query saw, or a
    padded query whose gradient reached a key, moves them by O(0.1))."""
    rows = Rows(*layout)
    gen = torch.Generator().manual_seed(0)
    b, length = len(rows.prompts), rows.width
    q = torch.randn(b, 4, length, 8, generator=gen)
    k, v = (torch.randn(b, 2, length, 8, generator=gen) for _ in range(2))
    weights = torch.randn(b, length, 4, 8, generator=gen)

    def run(buckets: bool):
        monkeypatch.setattr(shared_prompt, "BUCKETS", buckets)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = shared_prompt.attend(rows, *leaves)
        (out * weights).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    plain, plain_grads = run(False)
    padded, padded_grads = run(True)
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded, _attend_reference(rows, q, k, v), rtol=0, atol=1e-5)
    for name, got, want in zip("qkv", padded_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


def test_attend_gives_sdpa_one_shape_a_bucket_whatever_the_row_length(monkeypatch):
    """The path taken: GRPO rows of prompts 50-54 and completions of other lengths (as consecutive steps of a job)
    reach SDPA in one set of shapes and strides (what torch keys cuDNN's graphs by) with buckets on, and in a new
    one for every row without; the automatic choice leaves the CPU's calls unpadded (no cuDNN there)."""
    calls = _sdpa_recorder(monkeypatch)
    groups = [(50, (5, 7, 6, 7)), (52, (6, 6, 7, 5)), (54, (7, 7, 5, 7))]

    def shapes(buckets):
        monkeypatch.setattr(shared_prompt, "BUCKETS", buckets)
        seen = []
        for prompt, lengths in groups:
            rows = Rows.single(prompt, list(lengths))
            q = torch.randn(1, 4, rows.width, 8)
            k, v = torch.randn(2, 1, 2, rows.width, 8)
            calls.clear()
            shared_prompt.attend(rows, q, k, v)
            assert len(calls) == 2, calls  # the causal call and the masked one
            seen.append(tuple(calls))
        return seen

    padded = shapes(True)
    assert len(set(padded)) == 1, padded
    (causal, masked) = padded[0]
    assert causal[0][0] == (1, 4, 64, 8) and masked[0][0] == (1, 4, 32, 8)  # 55-61 → 64; 18-20 later → 32
    assert masked[1][0] == (1, 4, 80, 8) and masked[3][0] == (1, 1, 32, 80)  # 75-80 keys, heads repeated
    assert len(set(shapes(False))) == len(groups)
    assert len(set(shapes(None))) == len(groups)  # CPU: not padded
    monkeypatch.setattr(shared_prompt, "BUCKET_MAX", 79)  # rows past it run at their exact lengths
    assert len(set(shapes(True))) == 2  # the rows of 75 and 76 positions padded, the one of 80 not
    assert shared_prompt.bucket(8160) == 8192 and shared_prompt.bucket(8271) == 9216
    for n in range(1, 5000):
        assert n <= shared_prompt.bucket(n) <= max(n * 1.125, n + 15), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_attend_pays_no_graph_build_for_a_new_row_length_in_a_seen_bucket():
    """A GRPO group as session 22's bench trains it (8B heads: 32 query, 8 kv, 128 wide; 8 completions of 63
    inputs; prompts near 8K), bf16 on CUDA, where SDPA runs cuDNN's kernels and torch builds a cuDNN graph per
    exact shape (bench/RESULTS.md, sdpa_new_shape: a new length's forward + backward costs tens of repeats). With
    the lengths in buckets, a new prompt length whose buckets were seen costs a repeat's time: bound 3x the repeat
    + 30 ms, far under a build. Exactness: the bucketed output and q/k/v gradients against fp32 stay within 2x the unbucketed
    bf16 run's error (plus bf16's 2^-9 of the largest value, for the ties of two roundings)."""
    import time

    def step(prompt: int, buckets: bool | None, dtype=torch.bfloat16, grads: bool = False):
        rows = Rows.single(prompt, [63] * 8)
        gen = torch.Generator(device="cuda").manual_seed(prompt)
        q = torch.randn(1, rows.width, 32, 128, device="cuda", generator=gen).transpose(1, 2)
        k, v = (
            torch.randn(1, rows.width, 8, 128, device="cuda", generator=gen).transpose(1, 2) for _ in range(2)
        )
        leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        w = torch.randn(1, rows.width, 32, 128, device="cuda", generator=gen)
        old = shared_prompt.BUCKETS
        shared_prompt.BUCKETS = buckets
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = shared_prompt.attend(rows, *leaves)
            (out.float() * w).sum().backward()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1000
        finally:
            shared_prompt.BUCKETS = old
        if grads:
            return ms, [out.float()] + [t.grad.float() for t in leaves]
        return ms

    assert shared_prompt._bucketed(torch.empty(1, device="cuda", dtype=torch.bfloat16))  # on by default here
    step(
        7750, None
    )  # the buckets' first call: cuDNN's graphs built (prompt + first 7,813 → 8,192; 448 x 9,216)
    repeat = min(step(7750, None) for _ in range(3))
    new = [step(p, None) for p in (7800, 7901, 8002, 8129)]  # new lengths, the same buckets
    unbucketed = [step(p, False) for p in (7811, 7912)]  # for the record: each new length builds its graphs
    print(
        f"attend fwd+bwd ms: repeat {repeat:.1f}, new lengths in seen buckets {new}, unbucketed {unbucketed}"
    )
    assert max(new) <= 3 * repeat + 30, (repeat, new)
    truth = step(8002, False, torch.float32, grads=True)[1]
    plain = step(8002, False, grads=True)[1]
    ours = step(8002, None, grads=True)[1]
    for name, t, p, o in zip(("out", "dq", "dk", "dv"), truth, plain, ours, strict=True):
        err_plain, err_ours = (p - t).abs().max().item(), (o - t).abs().max().item()
        assert err_ours <= 2 * err_plain + 2**-9 * t.abs().max().item(), (name, err_plain, err_ours)
