"""Gemma 2 and Gemma 3 (text) on strop's kernels: patched and unpatched models train identically.

Parity (CPU tier, fp32), as ``test_patch.py`` does it for the Llama family: a PEFT model over the HF model
(LoRA on all seven projections, non-zero B), and the same over an NF4 double-quantized base; at every step
the patched twin's loss and LoRA gradients must equal the unpatched reference's within the fp32 bound
S · √K · u (``test_patch.parity_bound``), with S counting Gemma's extra reductions: four RMSNorms per layer
instead of two (and Gemma 3's q/k norms), so 8 + 2 (+ 2) per layer and pass.

The fixture is built so that each Gemma-specific piece changes the loss far beyond that bound (checked by
``test_every_gemma_feature_moves_the_reference_loss_and_gradients``), so a patched path that ignored one would fail:
random norm weights (HF initialises Gemma's to 0, where (1 + w) = 1 hides a wrong offset), weights with
std 0.1 and soft-caps low enough that attention scores and logits reach them (Gemma 2: 1 on attention, 3 on
the final logits; the released 50 and 30 barely touch a tiny random model's),
``query_pre_attn_scalar`` ≠ head_dim (the scaling is not the default 1/√d), sequences of 10 tokens past a
sliding window of 4, and a 6-layer Gemma 3 (five sliding layers with RoPE base 100, one full with 10⁶; the
released local base, 10⁴, hardly rotates within 10 positions).

The Triton interpreter runs one program per row, so the CPU tier keeps these to one 10-token row and two
teacher-forced steps (the second after an AdamW update, so the adapters have moved).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = locked("transformers")
peft = locked("peft")

from strop.common.archs import ARCHS  # noqa: E402
from strop.kernels.models import patch_model  # noqa: E402

from .test_patch import UNIT_ROUNDOFF, _check_parity, _peft, _rel, nf4_reload  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW, T, VOCAB = 4, 10, 300
LAYERS = {"gemma2": 2, "gemma3_text": 6}
# Gemma 2's SDPA path refuses soft-capping (HF: _supports_sdpa = False), so it loads eager; Gemma 3 SDPA.
ATTN = {"gemma2": "eager", "gemma3_text": "sdpa"}
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}


def gemma_config(model_type: str, **overrides):
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS[model_type],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.1,
    )
    if model_type == "gemma2":
        common.update(attn_logit_softcapping=1.0, final_logit_softcapping=3.0)
    else:
        common["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        }
    return transformers.AutoConfig.for_model(model_type, **{**common, **overrides})


def gemma_model(model_type: str, qlora: bool = False, tmp_path=None, **overrides):
    torch.manual_seed(0)
    cfg = gemma_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN[model_type]).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (1 + w) with w ≠ 0: a wrong offset or cast order shows
                p.copy_(0.3 * torch.randn(p.shape))
    if qlora:
        model = nf4_reload(model, tmp_path / model_type, ATTN[model_type])
    return model.to(DEVICE)


def gemma_bound(config) -> float:
    """S · √K · u with S = 2 · (8 + 2 sandwich norms + 2 q/k norms) per layer + 4 (head and loss)."""
    arch = ARCHS[config.model_type]
    per_layer = 8 + 2 * arch.sandwich_norms + 2 * arch.qk_norm
    longest = max(config.hidden_size, config.intermediate_size, config.vocab_size)
    return (2 * per_layer * config.num_hidden_layers + 4) * longest**0.5 * UNIT_ROUNDOFF


def gemma_ids():
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2)).to(DEVICE)


def _parity(model, model_type, **kw):
    cfg = model.get_base_model().config
    # one batch, repeated: over two steps the reference loss must fall on it
    return _check_parity(model, model_type, steps=2, batches=[gemma_ids()], bound=gemma_bound(cfg), **kw)


@pytest.mark.parity
@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_patched_gemma_trains_like_the_reference(model_type, qlora, tmp_path):
    # QLoRA's Gemma 3 keeps one layer of each type (the six-layer LoRA run covers the 5:1 pattern)
    small = TWO_LAYERS if qlora and model_type == "gemma3_text" else {}
    _parity(_peft(gemma_model(model_type, qlora, tmp_path, **small)), model_type)


def test_every_gemma_feature_moves_the_reference_loss_and_gradients():
    """The parity fixture exercises what the patch must reproduce: each feature, changed in HF's own model,
    moves the loss or a gradient by more than 10× the parity bound, so a patched path ignoring it could not
    pass."""
    ids = gemma_ids()

    def loss_and_grads(model_type, **overrides):
        model = gemma_model(model_type, **overrides)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    full, local = (
        gemma_config("gemma3_text").rope_parameters[t] for t in ("full_attention", "sliding_attention")
    )
    changes = {
        "gemma2": {
            "sliding window": {"sliding_window": 64},
            "attention soft-cap": {"attn_logit_softcapping": None},
            "final logit soft-cap": {"final_logit_softcapping": None},
            "query_pre_attn_scalar": {"query_pre_attn_scalar": 16},
        },
        "gemma3_text": {
            "sliding window": {"sliding_window": 64},
            # the full layer with the sliding layers' RoPE, and the sliding layers with the full layer's
            "RoPE of the full layer": {
                "rope_parameters": {"full_attention": local, "sliding_attention": local}
            },
            "RoPE of the sliding layers": {
                "rope_parameters": {"full_attention": full, "sliding_attention": full}
            },
        },
    }
    for model_type, cases in changes.items():
        (base, base_grads), bound = loss_and_grads(model_type), gemma_bound(gemma_config(model_type))
        for what, overrides in cases.items():
            loss, grads = loss_and_grads(model_type, **overrides)
            moved = max(abs(loss - base) / base, *(_rel(grads[n], g) for n, g in base_grads.items()))
            assert moved > 10 * bound, (
                f"{model_type}: {what} moves the loss or a gradient by {moved:.2g} ({bound=:.2g})"
            )
    cfg = gemma_config("gemma3_text")
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}, cfg.layer_types


def test_gemma_norms_run_in_gemma_mode_and_the_head_is_the_tied_embedding():
    model = _peft(gemma_model("gemma3_text"))
    report = patch_model(model)
    hf = model.get_base_model()
    layer = hf.model.layers[0]
    for norm in (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm,
        layer.self_attn.q_norm,
        hf.model.norm,
    ):
        assert "forward" in norm.__dict__, f"{type(norm).__name__} not patched: {report}"
    assert hf.lm_head.weight is hf.model.embed_tokens.weight, "Gemma ties the LM head to the embedding"
    x = torch.randn(3, 64, device=DEVICE)
    norm = layer.post_feedforward_layernorm
    with torch.no_grad():
        expected = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)) * (1 + norm.weight)
        torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parity
def test_gemma_offloaded_recompute_keeps_the_down_projection_and_trains_like_the_reference(monkeypatch):
    """Gemma's MLP is followed by post_feedforward_layernorm, which saves the MLP's output for its backward:
    the recompute must compute the down projection (the skip for Llama layers, whose MLP is the last op,
    must not apply). Offloaded checkpointing (every layer recomputed) must give the reference's gradients,
    with two down GEMMs per layer and step (forward and recompute)."""
    from strop.kernels.models import enable_offloaded_checkpointing

    from .test_offload import count_down_projections

    downs = count_down_projections(monkeypatch)

    def offloaded(twin):
        return enable_offloaded_checkpointing(
            twin, offload_cpu_tensors=True, min_offload_bytes=0, keep_last=0
        )

    offloader = _parity(_peft(gemma_model("gemma2")), "gemma2", prepare_twin=offloaded)
    assert offloader.stats.offloaded > 0, offloader.stats
    assert downs["n"] == 2 * 2 * LAYERS["gemma2"], (
        f"{downs['n']} down GEMMs over 2 steps (forward + recompute)"
    )


@pytest.mark.parity
def test_gemma_long_context_memory_mode_trains_like_the_reference():
    # offloaded inputs + tiled MLP over the patched Gemma 3 layers (q/k norms, two RoPE bases)
    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode

    def long_context(twin):
        twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return apply_memory_mode(
            twin,
            MemoryMode.LONG_CONTEXT,
            step=StepShape(2, 16),
            offload_cpu_tensors=True,
            min_offload_bytes=0,
        )

    model = _peft(gemma_model("gemma3_text", **TWO_LAYERS))
    installed = _parity(model, "gemma3_text", prepare_twin=long_context)
    assert installed.memory.offloader.stats.offloaded > 0 and installed.memory.tiled_mlp.tiled, installed


def test_gemma_parts_without_a_fast_path_keep_the_reference_and_say_why(caplog):
    import logging

    model = _peft(gemma_model("gemma2", hidden_activation="relu"))
    model.get_base_model().config.logit_scale = 0.5  # a logit scaling the fused CE does not apply
    ids = gemma_ids()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss.item()
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        report = patch_model(model)
    assert set(report.skipped["lora_mlp"].values()) == {"activation hidden_activation='relu'"}, report
    assert (
        "config.logit_scale is set (0.5: scaled logits)" in report.skipped["fused_cross_entropy"].values()
    ), report
    assert "hidden_activation='relu'" in caplog.text and "logit_scale" in caplog.text
    assert len(report.patched["rms_norm"]) == 9 and len(report.patched["lora_qkv"]) == 2, report
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids).loss.item()
    assert abs(out - ref) <= gemma_bound(model.get_base_model().config) * ref, (out, ref)


# ---- the chunked DPO loss on a soft-capped head ------------------------------------------------------------


def test_chunked_sequence_logps_apply_gemma2_final_softcap_like_hf_logits(monkeypatch):
    """Per-sequence log-probs from Gemma 2's final hidden states with the chunked loss (Triton kernel, and its
    torch fallback) equal those from HF's own (soft-capped) logits, and so do their gradients; without the
    soft-cap they would not (the cap of 3 binds on this fixture)."""
    import strop.kernels.losses.logps as logps_engine

    model = gemma_model("gemma2")
    cap = model.config.final_logit_softcapping
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        hf_logits = model(input_ids=ids).logits.float()  # HF applies c · tanh(logits / c)
    targets = labels[:, 1:]
    mask = targets != -100
    per_token = hf_logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    hf_logps = (per_token * mask).sum(1)
    head = model.lm_head.weight.detach()

    def chunked(h):
        return logps_engine.sequence_logps(h, head, labels, softcap=cap, chunk_size=7)

    h = hidden.clone().requires_grad_()
    ref_h = hidden.clone().requires_grad_()
    ref = logps_engine.sequence_logps_reference(ref_h, head, labels, softcap=cap)
    torch.testing.assert_close(ref.detach(), hf_logps, rtol=1e-5, atol=1e-5)
    weights = torch.tensor([0.3, -1.0, 2.0, 0.5], device=DEVICE)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), ref_h)
    for backend in ("triton", "torch"):
        if backend == "torch":
            monkeypatch.setattr(logps_engine, "_use_triton", lambda device: False)
        out = chunked(h)
        (grad,) = torch.autograd.grad((out * weights).sum(), h)
        torch.testing.assert_close(out.detach(), hf_logps, rtol=1e-5, atol=1e-5, msg=backend)
        assert _rel(grad, ref_grad) <= 1e-5, (backend, _rel(grad, ref_grad))
    with torch.no_grad():
        uncapped = logps_engine.sequence_logps(hidden, head, labels)
    assert (uncapped - hf_logps).abs().max() > 0.1, "the soft-cap binds: leaving it out is visibly wrong"


def test_dpo_trainer_glue_keeps_the_chunked_loss_for_gemma2_and_passes_its_softcap():
    import types

    from strop.kernels.trainers.dpo import StropDPOMixin

    model = _peft(gemma_model("gemma2"))
    for p in model.parameters():
        p.requires_grad_(False)  # frozen head (LoRA never trains it)
    fake = types.SimpleNamespace(
        loss_types=["sigmoid"],
        f_divergence_type="reverse_kl",
        model=model,
        accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
    )
    fake._strop_hf_model = types.MethodType(StropDPOMixin._strop_hf_model, fake)
    assert StropDPOMixin._strop_unsupported_reason(fake) is None, "a soft-capped head no longer falls back"
    assert StropDPOMixin._strop_softcap(fake, model) == 3.0
    model.get_base_model().config.logit_scale = 2.0  # a scaling the chunked loss does not apply
    assert "logit_scale" in StropDPOMixin._strop_unsupported_reason(fake)


# ---- GPU tier: Gemma 3 1B shape in bf16 ----------------------------------------------------------------------

BF16_UNIT_ROUNDOFF = 2.0**-8


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for _, g in sorted(grads.items())])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_patched_gemma3_1b_shape_matches_the_reference_in_bf16_and_reports_tokens_per_second():
    """Gemma 3 1B's shape (hidden 1152, intermediate 6912, 26 layers, 4 heads / 1 KV head of 256, vocab 262,144,
    window 512, five sliding layers per full one), random weights in bf16, fp32 LoRA r=16 on all seven
    projections, bf16 autocast, checkpointed layers, 2 × 1024 tokens (past the window). The bf16 rule
    (DESIGN, ``_tolerances.assert_bf16_within_torch_bound``): against an fp32 run of the same model, the patched
    loss and LoRA gradients may be off by at most twice what the unpatched HF + PEFT bf16 run is off, plus one
    bf16 rounding (2⁻⁸ relative: no bf16 result is closer than that by construction). Tokens/s of both are
    printed for 4 × 2048 tokens."""
    import copy
    import time

    cfg = gemma_config(
        "gemma3_text",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        max_position_embeddings=4096,
        initializer_range=0.02,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=torch.bfloat16
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape))
    model = _peft(model.to("cuda"), r=16, lora_alpha=32)
    truth_model = copy.deepcopy(model).float()  # fp32 weights and adapters, no autocast: the reference truth
    for m in (model, truth_model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 1024), generator=gen).cuda()
    # throughput on a longer batch, where the step is compute-bound rather than launch-bound
    long_ids = torch.randint(0, cfg.vocab_size, (4, 2048), generator=gen).cuda()

    def step(m, autocast=True, ids=ids):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}

    def tokens_per_second(m, steps=3):
        for _ in range(2):  # warm-up: the Triton compiles (patched), cuDNN's attention plans (both)
            step(m, ids=long_ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(m, ids=long_ids)
        torch.cuda.synchronize()
        return steps * long_ids.numel() / (time.perf_counter() - start)

    truth_loss, truth = step(truth_model, autocast=False)
    del truth_model
    torch.cuda.empty_cache()
    ref_loss, ref = step(model)
    ref_tps = tokens_per_second(model)
    report = patch_model(model)
    assert not any(report.skipped.values()), report
    assert len(report.patched["rms_norm"]) == 26 * 6 + 1, report
    loss, ours = step(model)
    tps = tokens_per_second(model)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30

    u = BF16_UNIT_ROUNDOFF
    loss_err, ref_loss_err = abs(loss - truth_loss), abs(ref_loss - truth_loss)
    flat_truth = _flat(truth)
    grad_err = float((_flat(ours) - flat_truth).norm() / flat_truth.norm())
    ref_grad_err = float((_flat(ref) - flat_truth).norm() / flat_truth.norm())
    worst = max((_rel(ours[n], t) - 2 * _rel(ref[n], t), n) for n, t in truth.items())
    print(
        f"\nGemma 3 1B shape, 2 x 1024 tokens, bf16: loss {loss:.5f} (HF+PEFT {ref_loss:.5f}, fp32 {truth_loss:.5f}); "
        f"LoRA grad error vs fp32 {grad_err:.3g} (HF+PEFT {ref_grad_err:.3g}); worst tensor excess {worst[0]:.3g} "
        f"({worst[1]}); at 4 x 2048 tokens {tps:,.0f} tokens/s patched vs {ref_tps:,.0f} HF+PEFT; peak {peak:.1f} GiB"
    )
    assert loss_err <= 2 * ref_loss_err + u * abs(truth_loss), (loss, ref_loss, truth_loss)
    assert grad_err <= 2 * ref_grad_err + u, (grad_err, ref_grad_err)
    assert worst[0] <= u, f"{worst[1]}: error vs fp32 exceeds 2 × HF+PEFT's + 2^-8 by {worst[0]:.3g}"
