"""Tiled MLP: gradients equal the untiled MLP's, for HF and LoRA MLPs and opaque callables, on token counts
the chunk count does not divide; dropout replays; installation on a model and its undo; GPU peak memory.

fp32 tolerance: the tiled backward computes each weight gradient as a sum of per-chunk GEMMs instead of
one GEMM over all tokens, the same terms regrouped; fp32 regrouping moves a sum by a few ulps of its
largest partial, so 1e-6 relative to the gradient's scale (plus rtol 1e-5) bounds it. The input gradient
and the output are computed row by row from the same ops and must match to the same bound.

GPU tier: Llama-3-8B's MLP (hidden 4096, intermediate 14,336) in bf16 at 65,536 tokens: untiled, backward
holds ~4 [tokens, intermediate] tensors (7 GiB of them); tiled "auto" must stay under a quarter of the
untiled extra memory.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models.tiled_mlp import (  # noqa: E402
    auto_num_chunks,
    disable_tiled_mlp,
    enable_tiled_mlp,
    tiled_mlp,
    tiled_mlp_reference,
)

H, INTER = 48, 136


def _mlp(bias: bool = False) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=4, mlp_bias=bias, hidden_act="silu"
    )
    torch.manual_seed(0)
    return transformers.models.llama.modeling_llama.LlamaMLP(cfg).float()


def _lora_mlp(dropout: float = 0.0) -> torch.nn.Module:
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _mlp()

    model = peft.get_peft_model(
        Wrapper(),
        peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"]
        ),
    )
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.base_model.model.mlp.train()


def _x(b: int = 2, t: int = 37, seed: int = 2) -> torch.Tensor:
    return torch.randn(b, t, H, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(out: torch.Tensor, wrt: list[torch.Tensor], seed: int = 3) -> tuple[torch.Tensor, ...]:
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, wrt, dy)


def _assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        actual,
        expected,
        rtol=1e-5,
        atol=1e-6 * expected.abs().max().item(),
        msg=lambda m: f"{what} differs beyond fp32 regrouping: {m}",
    )


@pytest.mark.parametrize("num_chunks", [2, 5, 7, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_equals_untiled_for_hf_mlp(num_chunks, bias):
    mlp = _mlp(bias)
    x = _x()  # 74 tokens: 5 and 7 chunks leave a short last chunk, 200 > 74 gives one row per chunk
    params = list(mlp.parameters())
    ref_out = tiled_mlp_reference(mlp, x)
    expected = _grads(ref_out, [x, *params])
    out = tiled_mlp(mlp, x, num_chunks=num_chunks)
    got = _grads(out, [x, *params])
    _assert_fp32_close(out, ref_out, "output")
    for (name, _), g, e in zip([("x", x), *mlp.named_parameters()], got, expected, strict=True):
        _assert_fp32_close(g, e, f"d{name}")


def test_lora_mlp_gives_gradients_only_to_trainable_params():
    mlp = _lora_mlp()
    x = _x(b=3, t=29)
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    assert len(trainable) == 6, "LoRA A and B on gate, up, down"
    expected = _grads(mlp(x), [x, *trainable])
    got = _grads(tiled_mlp(mlp, x, num_chunks=4), [x, *trainable])
    for g, e in zip(got, expected, strict=True):
        _assert_fp32_close(g, e, "LoRA MLP gradient")
    loss = tiled_mlp(mlp, x, num_chunks=4).sum()
    loss.backward()
    frozen = [n for n, p in mlp.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen base weights got gradients: {frozen}"


def test_dropout_masks_replay_in_backward():
    # With LoRA dropout each chunk draws its own mask; backward must recompute with the same masks, so
    # the gradient equals that of the same chunked computation differentiated directly by autograd.
    mlp = _lora_mlp(dropout=0.3)
    x = _x(t=31)
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    torch.manual_seed(7)
    eager = torch.cat([mlp(c) for c in x.reshape(1, -1, H).split(16, dim=1)], dim=1).view_as(x)
    expected = _grads(eager, [x, *trainable])
    torch.manual_seed(7)
    out = tiled_mlp(mlp, x, num_chunks=4)  # 62 tokens → chunks of 16, 16, 16, 14
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    got = _grads(out, [x, *trainable])
    for g, e in zip(got, expected, strict=True):
        _assert_fp32_close(g, e, "gradient under dropout")


def test_opaque_callable_with_explicit_params_and_2d_input():
    w1 = torch.randn(H, 80, requires_grad=True)
    w2 = torch.randn(80, H, requires_grad=True)

    def fn(x):
        return torch.nn.functional.gelu(x @ w1) @ w2

    x = torch.randn(41, H, requires_grad=True)
    expected = _grads(fn(x), [x, w1, w2])
    got = _grads(tiled_mlp(fn, x, num_chunks=3, params=[w1, w2]), [x, w1, w2])
    for g, e in zip(got, expected, strict=True):
        _assert_fp32_close(g, e, "opaque fn gradient")


def test_no_grad_runs_chunked_forward_only():
    mlp = _mlp()
    x = _x().detach()
    with torch.no_grad():
        out = tiled_mlp(mlp, x, num_chunks=3)
    assert out.grad_fn is None
    _assert_fp32_close(out, mlp(x).detach(), "no-grad output")


def test_auto_chunks_follow_the_intermediate_budget():
    # Llama-3-8B at 256K tokens, bf16: 4 × 14,336 × 2 bytes per token → 9,362 tokens per GiB chunk,
    # and 262,144 / 9,362 = 28.001 → 29 chunks.
    assert auto_num_chunks(262144, 14336, 2) == 29
    assert auto_num_chunks(8192, 14336, 2) == 1, "8K tokens fit one chunk: no tiling at ordinary lengths"
    assert auto_num_chunks(100, 10, 4, budget_bytes=160) == 100, "one token per chunk at the floor"
    mlp = _mlp()
    x = _x()
    # 4 × 136 × 4 = 2,176 bytes per token: a 40,000-byte budget holds 18 rows, so 74 tokens need 5 chunks
    assert auto_num_chunks(74, INTER, 4, budget_bytes=40_000) == 5
    expected = _grads(mlp(x), [x])
    got = _grads(tiled_mlp(mlp, x, budget_bytes=40_000), [x])
    _assert_fp32_close(got[0], expected[0], "auto-chunked dx")


def test_bad_arguments_raise():
    mlp = _mlp()
    with pytest.raises(ValueError, match="num_chunks"):
        tiled_mlp(mlp, _x(), num_chunks=0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        tiled_mlp(mlp, torch.randn(H), num_chunks=2)
    with pytest.raises(ValueError, match="num_chunks"):
        enable_tiled_mlp(torch.nn.Linear(2, 2), "many")


def _tiny_lora_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.train()


def _model_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_enable_on_peft_model_matches_untiled_training_step_and_disable_restores():
    model = _tiny_lora_llama()
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    expected = _model_step(model, ids)
    report = enable_tiled_mlp(model, 3)
    assert report.tiled == ["model.layers.0.mlp", "model.layers.1.mlp"] and not report.skipped
    got = _model_step(model, ids)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, g in got[1].items():
        _assert_fp32_close(g, expected[1][name], name)
    assert disable_tiled_mlp(model) is True
    mlps = [layer.mlp for layer in model.get_base_model().model.layers]
    assert all("forward" not in m.__dict__ for m in mlps), "disable must restore the class forward"
    assert disable_tiled_mlp(model) is False


def test_tiles_strop_patched_lora_mlp():
    # patch_model first (its fused LoRA MLP writes dX over its input: each chunk's own rows), then tile.
    patch = importlib.import_module("strop.kernels.models.patch")
    model = _tiny_lora_llama()
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    assert len(patch.patch_model(model).patched["lora_mlp"]) == 2, (
        "the fused LoRA MLP must be what gets tiled"
    )
    expected = _model_step(model, ids)
    report = enable_tiled_mlp(model, 4)
    assert len(report.tiled) == 2
    got = _model_step(model, ids)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)
    for name, g in got[1].items():
        _assert_fp32_close(g, expected[1][name], name)
    disable_tiled_mlp(model)
    patch.unpatch_model(model)


def _offloaded_tiled_step(model, ids, skip: bool, monkeypatch):
    """One training step under strop's offloaded checkpointing with 3-chunk tiled MLPs; the loss, the gradients
    and how many times each layer's down projection ran."""
    import importlib

    from strop.kernels.models.checkpointing import (
        disable_offloaded_checkpointing,
        enable_offloaded_checkpointing,
    )

    if not skip:
        tm = importlib.import_module(
            "strop.kernels.models.tiled_mlp"
        )  # the package exports a function of its name
        monkeypatch.setattr(tm, "_out_features", lambda fn: None)
    enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0, keep_last=0)
    enable_tiled_mlp(model, 3)
    calls = [0, 0]
    hooks = [
        layer.mlp.down_proj.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(model.get_base_model().model.layers)
    ]
    try:
        loss, grads = _model_step(model, ids)
    finally:
        for h in hooks:
            h.remove()
        disable_tiled_mlp(model)
        disable_offloaded_checkpointing(model)
        monkeypatch.undo()
    return loss, grads, calls


def test_under_offloaded_checkpointing_the_recompute_skips_the_tiled_forward_with_bitwise_equal_gradients(
    monkeypatch,
):
    # per layer and chunk: forward (no grad), recompute in backward, the tiled backward's own recompute; the
    # recompute's output is never read (kernels/lora/mlp.py), so its 3 chunk forwards need not run
    model = _tiny_lora_llama()
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    loss_full, grads_full, calls_full = _offloaded_tiled_step(model, ids, skip=False, monkeypatch=monkeypatch)
    loss, grads, calls = _offloaded_tiled_step(model, ids, skip=True, monkeypatch=monkeypatch)
    assert calls_full == [9, 9] and calls == [6, 6], (calls_full, calls)
    assert torch.equal(loss, loss_full)
    assert grads.keys() == grads_full.keys() and any("mlp" in n for n in grads)
    for name, g in grads.items():
        assert torch.equal(g, grads_full[name]), f"{name} differs"
    expected = _model_step(model, ids)  # and both are the plain (untiled, unchecked) step's
    for name, g in grads.items():
        _assert_fp32_close(g, expected[1][name], name)


def test_a_patched_mlp_skips_its_down_projection_in_the_tiled_backward_with_bitwise_equal_gradients(
    monkeypatch,
):
    # the tiled backward differentiates each chunk's recompute and never reads its value: the fused LoRA MLP
    # then skips h W_d^T (kernels/lora/mlp.py); counted as forward_projections calls over the down projection
    import contextlib
    import importlib

    patch = importlib.import_module("strop.kernels.models.patch")
    lora_mlp = importlib.import_module("strop.kernels.lora.mlp")
    tm = importlib.import_module("strop.kernels.models.tiled_mlp")
    model = _tiny_lora_llama()
    patch.patch_model(model)
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    enable_tiled_mlp(model, 3)
    downs = [0]
    real = lora_mlp.forward_projections

    def counting(x, projs, *args, **kwargs):
        downs[0] += len(projs) == 1
        return real(x, projs, *args, **kwargs)

    monkeypatch.setattr(lora_mlp, "forward_projections", counting)
    monkeypatch.setattr(tm, "recompute_outputs_unused", contextlib.nullcontext)
    full = _model_step(model, ids)
    assert downs == [2 * 3 * 2], downs  # 2 layers x 3 chunks, forward and backward
    monkeypatch.undo()
    monkeypatch.setattr(lora_mlp, "forward_projections", counting)
    downs[0] = 0
    got = _model_step(model, ids)
    assert downs == [2 * 3], downs  # the forward's only
    assert torch.equal(got[0], full[0])
    for name, g in got[1].items():
        assert torch.equal(g, full[1][name]), name
    disable_tiled_mlp(model)
    patch.unpatch_model(model)


def test_the_recompute_keeps_the_tiled_forward_where_the_layer_reads_the_mlp_output(monkeypatch):
    # Gemma's decoder layer normalises the MLP's output before its residual add (the norm saves it)
    from strop.fixtures.tiny_models import TinyShape, build_config

    shape = TinyShape(hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    cfg = build_config("gemma3_text", shape, 300)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj"])
    )
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    _, _, calls = _offloaded_tiled_step(model.train(), ids, skip=True, monkeypatch=monkeypatch)
    assert calls == [9, 9]


@pytest.mark.gpu
def test_gpu_tiled_mlp_peak_memory_at_long_sequence():
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, hidden_act="silu")
    with torch.device("cuda"):
        mlp = transformers.models.llama.modeling_llama.LlamaMLP(cfg).to(torch.bfloat16).requires_grad_(False)
    tokens = 65536
    x = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def peak_extra(fn):
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(x).backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, x.grad.clone()

    untiled_extra, dx_ref = peak_extra(mlp)
    tiled_extra, dx = peak_extra(lambda t: tiled_mlp(mlp, t))
    intermediate = tokens * 14336 * 2  # 1.75 GiB
    # Untiled: gate, up, act(gate) and their product are saved (4 × 1.75 GiB), plus backward temporaries.
    assert untiled_extra >= 4 * intermediate, f"untiled needs {untiled_extra / 2**30:.2f} GiB"
    # Tiled "auto": 8 chunks of ≤ 9,362 tokens. The output y and dx (0.5 GiB each) plus one chunk's
    # recompute (4 × 256 MiB saved, about as much again in backward temporaries) ≈ 3 GiB.
    assert tiled_extra <= 3.5 * 2**30, f"tiled needs {tiled_extra / 2**30:.2f} GiB"
    # bf16: tiled and untiled run the same bf16 GEMMs per row; allow bf16 rounding of the sum over chunks.
    err = (dx.float() - dx_ref.float()).abs().max().item()
    assert err <= 1e-2 * dx_ref.float().abs().max().item()
