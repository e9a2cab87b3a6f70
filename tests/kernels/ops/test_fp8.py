"""FP8 frozen-base GEMMs (``kernels/ops/fp8.py``, ``patch_model(fp8_base=True)``) against their definitions.

Method. The quantizer is checked bit for bit against its torch reference (the CPU tier runs the Triton kernel
under the interpreter) and against the rounding bound of e4m3: a normal value keeps 3 mantissa bits, so round to
nearest is off by at most half a step, 2⁻⁴ of its magnitude; a subnormal (|v| < 2⁻⁶ after scaling) by at most
half of the 2⁻⁹ step; scaled back by s: |s·Q(x) − x| ≤ 2⁻⁴|x| + 2⁻¹⁰ s. The scaled GEMM is checked against the
same product in fp64 from the codes (one bf16 rounding and at most K accumulator roundings: ≤ 2⁻⁸|y| + K·u Σ|â||b̂|,
u = 2⁻²³ for fp32, 2⁻¹³ for Hopper's FP8 tensor cores), and
against the exact product within the bound those per-operand errors give, elementwise: Σ_k |δa||b| + |a||δb| +
|δa||δb| plus the first bound.

The LoRA functions with FP8 bases are checked against an fp64 reference that computes exactly what the FP8 path
defines: base products from the codes and scales of x, dy and the attached copies, LoRA products from x and dy
in full. Their difference is a few bf16 roundings (the base GEMM's output, the LoRA factors cast to bf16, the
rank-r update): relative error in Frobenius norm ≤ 2⁻⁶. The fused MLP quantizes h and the activation
gradients it makes inside, so it is checked by what it runs (three base GEMMs each way, all FP8) and against the
exact fp64 MLP: with each operand rounded to e4m3 (RMS relative error ≤ 2⁻⁴/√3 for RNE) the base products carry
RMS relative error ≤ √2 · 2⁻⁴/√3 ≈ 0.051 per GEMM stage, two stages ≈ 0.072; bound 0.1. The FP8 path's error must
also exceed the exact bf16 path's, or FP8 was not used.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from strop.kernels.lora import linear as linear_mod
from strop.kernels.lora.linear import attach_fp8, detach_fp8, fp8_of, lora_linear, lora_qkv
from strop.kernels.lora.mlp import lora_mlp, lora_mlp_reference
from strop.kernels.ops.fp8 import (
    FP8,
    Fp8Weight,
    fp8_weight,
    mm_fp8,
    quantize_rows,
    quantize_rows_reference,
)
from strop.kernels.ops.nf4 import dequantize_weight
from tests.kernels.lora.test_lora import _nf4, _rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def count_fp8_gemms(monkeypatch) -> dict[str, int]:
    """Count the FP8 base GEMMs run from now on: {"forward": x Wᵀ calls, "backward": dy W calls}."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        orig = getattr(Fp8Weight, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(Fp8Weight, name, counted)
    return calls


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.double() * s.double()


def _hard_rows(dtype) -> torch.Tensor:
    """Rows whose scale is 1 (amax 448): e4m3 ties (to even both ways), binade carries, subnormals and their ties,
    a zero row, and random rows of very different magnitudes."""
    ties = [
        448.0,
        1.0625,
        1.1875,
        124.0,
        125.2,
        127.9,
        -3.75,
        2.0**-7 + 2.0**-10,
        3 * 2.0**-10,
        2.0**-12,
        0.0,
        -0.0,
    ]
    rows = torch.zeros(6, 64)
    rows[0, : len(ties)] = torch.tensor(ties)
    rows[1] = torch.randn(64) * 1e-3
    rows[2] = torch.randn(64) * 1e4
    rows[3, 5] = -7.5  # one non-zero: amax is that value
    rows[5] = torch.randn(64)
    return rows.to(dtype).to(DEVICE)  # row 4: all zeros


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_quantize_rows_is_bitwise_the_reference_and_within_half_a_step(dtype):
    for x in (_hard_rows(dtype), torch.randn(37, 200, device=DEVICE).to(dtype)):
        q, s = quantize_rows(x)
        qr, sr = quantize_rows_reference(x)
        assert q.dtype == FP8 and s.shape == (x.shape[0], 1)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(s, sr)
        xd = x.double()
        bound = 2.0**-4 * xd.abs() + 2.0**-10 * s.double()
        assert ((_deq(q, s) - xd).abs() <= bound).all()
        assert (
            q.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0] == 448
        ).all()  # amax maps to the top code
    q, s = quantize_rows(_hard_rows(dtype))  # the zero row: zero codes, a finite scale
    assert q[4].float().abs().sum() == 0 and torch.isfinite(s).all()


def test_quantize_rows_reads_row_and_column_strided_views():
    wide = torch.randn(9, 160, device=DEVICE, dtype=BF16)
    view = wide[:, 32:96]
    q, s = quantize_rows(view)
    qr, sr = quantize_rows_reference(view.contiguous())
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    q, s = quantize_rows(wide.t())  # column-strided: quantized from a contiguous copy
    qr, sr = quantize_rows_reference(wide.t().contiguous())
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_the_two_weight_copies_are_the_rows_of_w_and_of_its_transpose():
    w = torch.randn(48, 80, device=DEVICE, dtype=BF16)
    f = fp8_weight(w)
    q, s = quantize_rows_reference(w)
    qt, st = quantize_rows_reference(w.t().contiguous())
    assert torch.equal(f.w.view(torch.uint8), q.view(torch.uint8)) and torch.equal(f.w_scale, s.view(1, -1))
    assert torch.equal(f.wt.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(
        f.wt_scale, st.view(1, -1)
    )
    assert f.nbytes == 2 * 48 * 80 + 4 * (48 + 80)


def _accumulation_unit() -> float:
    """The unit roundoff of the scaled GEMM's accumulator: fp32 on the CPU; on Hopper the FP8 tensor cores keep
    13 mantissa bits (an e8m13 accumulator, truncated: DeepSeek-V3 §3.3.2, PyTorch's FP8 notes), 2⁻¹³ per add."""
    return 2.0**-13 if DEVICE == "cuda" else 2.0**-23


@pytest.mark.parametrize("m,k,n", [(33, 64, 48), (16, 224, 96)])
def test_scaled_gemms_apply_the_rowwise_scales_exactly(m, k, n):
    """Integer codes |c| ≤ 8 make every partial sum an integer below 8 · 8 · 224 < 2¹⁴, exact in any accumulator
    with 14 significant bits, so the GPU's result is the fp64 product of the dequantized operands within the fp32
    scaling and one bf16 rounding (2⁻⁸) — whatever its accumulator. The CPU's kernel scales the operands to fp32
    before its fp32 GEMM: K roundings of 2⁻²³ each on Σ|â||b̂| more (cancellations make exact zeros 1e-6)."""
    a = torch.randint(-8, 9, (m, k), device=DEVICE).to(FP8)
    b = torch.randint(-8, 9, (n, k), device=DEVICE).to(FP8)  # row-major [N, K]: the GEMM reads its transpose
    sa = torch.rand(m, 1, device=DEVICE) * 3 + 0.25
    sb = torch.rand(1, n, device=DEVICE) * 3 + 0.25
    y = mm_fp8(a, sa, b.t(), sb, BF16)
    emu = _deq(a, sa) @ _deq(b, sb.t()).t()
    assert y.dtype == BF16 and y.shape == (m, n)
    cpu_scaling = k * 2.0**-23 * (_deq(a, sa).abs() @ _deq(b, sb.t()).abs().t())
    assert ((y.double() - emu).abs() <= 2.0**-8 * emu.abs() + cpu_scaling).all()


@pytest.mark.parametrize("m,k,n", [(33, 64, 48), (16, 224, 96)])
def test_scaled_gemms_match_their_codes_and_the_exact_product_within_the_rounding_bound(m, k, n):
    x = torch.randn(m, k, device=DEVICE, dtype=BF16)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(BF16)
    dy = torch.randn(m, n, device=DEVICE, dtype=BF16)
    f = fp8_weight(w)
    cases = [  # (result, a codes+scale, b [K, N] dequantized, exact a, exact b)
        (f.forward(*quantize_rows(x), BF16), quantize_rows(x), _deq(f.w, f.w_scale.t()).t(), x, w.t()),
        (f.backward(*quantize_rows(dy), BF16), quantize_rows(dy), _deq(f.wt, f.wt_scale.t()).t(), dy, w),
    ]
    for y, (aq, sa), b_hat, a, b in cases:
        assert y.dtype == BF16
        a_hat = _deq(aq, sa)
        emu = a_hat @ b_hat
        inner = a.shape[1]
        # at most one accumulator rounding per product, each within one unit of the running sum ≤ Σ|â||b̂|
        acc = inner * _accumulation_unit() * (a_hat.abs() @ b_hat.abs())
        assert ((y.double() - emu).abs() <= 2.0**-8 * emu.abs() + acc + 1e-30).all()
        a64, b64 = a.double(), b.double()
        da, db = (a_hat - a64).abs(), (b_hat - b64).abs()
        bound = da @ b64.abs() + a64.abs() @ db + da @ db + 2.0**-8 * emu.abs() + acc
        assert ((y.double() - a64 @ b64).abs() <= bound).all()


def _proj(out_f, in_f, r=8, *, nf4=False, bias=False, seed=0, forward=True):
    """A frozen bf16 (or NF4) base with fp32 adapters, non-zero B, and its FP8 copies attached (``forward=False``:
    the dx copy alone)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(BF16).to(DEVICE)
    base = _nf4(w) if nf4 else w
    a = (torch.randn(r, in_f, generator=g) / in_f**0.5).to(DEVICE).requires_grad_()
    b = (torch.randn(out_f, r, generator=g) / r**0.5).to(DEVICE).requires_grad_()
    bias_t = torch.randn(out_f, generator=g).to(BF16).to(DEVICE) if bias else None
    attach_fp8(base, forward=forward)
    return (base, a, b, 0.75, bias_t)


def _fp8_reference(x, dys, projs):
    """fp64: each y_i = base_i(Q(x)) + bias_i + s_i (x A_iᵀ) B_iᵀ and the gradients of the FP8 path's definition
    (dx = Σ_i deq(Q(dy_i)) deq(Q(W_iᵀ))ᵀ + s_i (dy_i B_i) A_i; dA, dB exact). A dx-only copy: base_i(x) = x W_iᵀ."""
    xq = _deq(*quantize_rows(x))
    x64 = x.double()
    ys, dx, d_a, d_b = [], 0, [], []
    for dy, (base, a, b, s, bias) in zip(dys, projs, strict=True):
        f: Fp8Weight = fp8_of(base, BF16)
        a64, b64, dy64 = a.double(), b.double(), dy.double()
        if f.w is None:
            base_y = (
                x64
                @ (dequantize_weight(base, dtype=BF16) if base.dtype == torch.uint8 else base).double().t()
            )
        else:
            base_y = xq @ _deq(f.w, f.w_scale.t()).t()
        y = base_y + s * (x64 @ a64.t()) @ b64.t()
        ys.append(y if bias is None else y + bias.double())
        g = s * dy64 @ b64
        dx = dx + _deq(*quantize_rows(dy)) @ _deq(f.wt, f.wt_scale.t()).t() + g @ a64
        d_a.append(g.t() @ x64)
        d_b.append(s * dy64.t() @ (x64 @ a64.t()))
    return ys, dx, d_a, d_b


@pytest.mark.parametrize("forward", [True, False], ids=["fwd+dx", "dx"])
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_lora_linear_and_qkv_on_fp8_bases_compute_the_fp8_definition(nf4, forward):
    x = torch.randn(15, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    one = [_proj(48, 64, nf4=nf4, bias=True, forward=forward)]
    three = [
        _proj(64, 64, nf4=nf4, seed=1, forward=forward),
        _proj(32, 64, nf4=nf4, seed=2, forward=forward),
        _proj(32, 64, nf4=nf4, seed=3, forward=forward),
    ]

    def run(projs):
        outs = lora_qkv(x, *projs) if len(projs) == 3 else (lora_linear(x, *projs[0]),)
        params = [x] + [t for p in projs for t in (p[1], p[2])]
        return outs, torch.autograd.grad(outs, params, dys)

    for projs in (one, three):
        dys = [torch.randn(15, linear_mod.out_features(p[0]), device=DEVICE, dtype=BF16) for p in projs]
        outs, grads = run(projs)
        ys, dx, d_a, d_b = _fp8_reference(x.detach(), dys, projs)
        for y, ref in zip(outs, ys, strict=True):
            assert _rel(y, ref) <= 2.0**-6
        assert _rel(grads[0], dx) <= 2.0**-6
        for i in range(len(projs)):
            assert _rel(grads[1 + 2 * i], d_a[i]) <= 2.0**-6
            assert _rel(grads[2 + 2 * i], d_b[i]) <= 2.0**-6
        for p in projs:
            detach_fp8(p[0])
            assert fp8_of(p[0], BF16) is None
        exact_outs, exact_grads = run(projs)
        # a dx-only copy leaves the forward the exact path's, bit for bit, and changes dx alone
        assert all(torch.equal(a, b) for a, b in zip(outs, exact_outs, strict=True)) is not forward
        assert not torch.equal(grads[0], exact_grads[0])


def test_fp8_runs_only_under_bf16_compute():
    base, *_ = p = _proj(48, 64)
    assert fp8_of(base, torch.float32) is None and fp8_of(base, BF16) is not None
    x = torch.randn(5, 64, device=DEVICE)
    exact = lora_linear(x, *p)  # fp32 input, no autocast: the exact fp32 path
    ref = x.double() @ base.double().t() + 0.75 * (x.double() @ p[1].double().t()) @ p[2].double().t()
    assert _rel(exact, ref) <= 1e-5
    with pytest.raises(ValueError, match="trainable"):
        attach_fp8(torch.randn(16, 16, requires_grad=True))
    with pytest.raises(ValueError, match=r"\[out, in\] = \[48, 40\]: not multiples of 16"):
        attach_fp8(torch.randn(48, 40, dtype=BF16))  # e4m3 tensor-core GEMMs need multiples of 16


@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_fused_mlp_with_dx_only_copies_runs_the_exact_forward_and_fp8_dx(monkeypatch, nf4):
    hidden, inter = 64, 128
    projs = [_proj(inter, hidden, seed=1, nf4=nf4), _proj(inter, hidden, seed=2, nf4=nf4)]
    projs.append(_proj(hidden, inter, seed=3, nf4=nf4))
    x = torch.randn(15, hidden, device=DEVICE, dtype=BF16, requires_grad=True)
    params = [x] + [t for p in projs for t in (p[1], p[2])]

    def run():
        out = lora_mlp(x, *projs)
        return out, torch.autograd.grad(out, params, dout)

    dout = torch.randn(15, hidden, device=DEVICE, dtype=BF16)
    for p in projs:
        detach_fp8(p[0])
    exact_out, exact_grads = run()
    for p in projs:
        attach_fp8(p[0], forward=False)
    calls = count_fp8_gemms(monkeypatch)
    out, grads = run()
    assert calls == {"forward": 0, "backward": 3}
    assert torch.equal(out, exact_out)  # the forward is the exact path's
    assert torch.equal(grads[6], exact_grads[6])  # dB_down reads dout and u alone: exact
    assert not torch.equal(grads[0], exact_grads[0])
    for p in projs:
        detach_fp8(p[0])


def test_fused_mlp_runs_every_base_gemm_in_fp8_within_the_rounding_bound(monkeypatch):
    hidden, inter = 64, 128
    gate, up, down = _proj(inter, hidden, seed=1), _proj(inter, hidden, seed=2), _proj(hidden, inter, seed=3)
    calls = count_fp8_gemms(monkeypatch)
    x = torch.randn(15, hidden, device=DEVICE, dtype=BF16, requires_grad=True)
    out = lora_mlp(x, gate, up, down)
    dout = torch.randn_like(out)
    params = [x] + [t for p in (gate, up, down) for t in (p[1], p[2])]
    ours = torch.autograd.grad(out, params, dout)
    assert calls == {"forward": 3, "backward": 3}

    def f64(p):
        return (
            p[0].double(),
            p[1].detach().double().requires_grad_(),
            p[2].detach().double().requires_grad_(),
            p[3],
        )

    def f16(p):
        return (p[0], p[1].detach().to(BF16).requires_grad_(), p[2].detach().to(BF16).requires_grad_(), p[3])

    truth_p = [f64(p) for p in (gate, up, down)]
    x64 = x.detach().double().requires_grad_()
    truth_out = lora_mlp_reference(x64, *truth_p)
    truth = [
        truth_out,
        *torch.autograd.grad(truth_out, [x64] + [t for p in truth_p for t in (p[1], p[2])], dout.double()),
    ]
    bf_p = [f16(p) for p in (gate, up, down)]
    xb = x.detach().clone().requires_grad_()
    bf_out = lora_mlp_reference(xb, *bf_p)  # torch's own bf16 MLP: the exact path's precision
    bf = [bf_out, *torch.autograd.grad(bf_out, [xb] + [t for p in bf_p for t in (p[1], p[2])], dout)]
    for i, (o, t) in enumerate(zip([out, *ours], truth, strict=True)):
        assert _rel(o, t) <= 0.1, (i, _rel(o, t))
    assert _rel(out, truth[0]) > _rel(bf[0], truth[0])  # FP8 was used: coarser than bf16
    for p in (gate, up, down):
        detach_fp8(p[0])


def test_stacked_nf4_gate_and_up_are_not_stacked_when_they_run_fp8():
    gate, up = _proj(128, 64, nf4=True, seed=1), _proj(128, 64, nf4=True, seed=2)
    projs = [linear_mod.LoRAProj(*p) for p in (gate, up)]
    assert linear_mod.stacked_weight(projs, BF16) is None
    for p in (gate, up):
        detach_fp8(p[0])
    assert linear_mod.stacked_weight(projs, BF16) is not None
    assert torch.equal(dequantize_weight(gate[0], dtype=BF16), linear_mod.stacked_weight(projs, BF16)[:128])
    for p in (gate, up):
        attach_fp8(p[0], forward=False)  # dx-only copies: the exact forward stacks, the FP8 backward does not
    assert linear_mod.stacked_weight(projs, BF16) is not None
    assert linear_mod.stacked_weight(projs, BF16, backward=True) is None
    for p in (gate, up):
        detach_fp8(p[0])


def _tiny_llama():
    """test_patch's 2-layer Llama with its adapters on all seven projections, bf16 base."""
    transformers = locked("transformers")
    from tests.kernels.models.test_patch import _config, _peft

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config("llama"), attn_implementation="sdpa", dtype=BF16
    )
    return _peft(model).to(DEVICE)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=BF16):  # as a user trains: bf16 compute, fp32 adapters
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.float().item(), [p.grad.float().clone() for p in model.parameters() if p.requires_grad]


def test_patch_model_fp8_base_trains_close_to_the_exact_patch_and_unpatches_clean():
    from strop.kernels.models import patch_model, unpatch_model

    model = _tiny_llama()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    patch_model(model)
    exact_loss, exact_grads = _loss_and_grads(model, ids)
    bases = [m.weight for n, m in model.named_modules() if n.endswith("base_layer")]
    assert len(bases) == 14 and all(fp8_of(w, BF16) is None for w in bases)  # the default is exact
    report = patch_model(model, fp8_base=True)
    assert all(fp8_of(w, BF16) is not None for w in bases)
    assert any("FP8 base GEMMs (opt-in, inexact) on 14 projections" in n for n in report.notes), report.notes
    loss, grads = _loss_and_grads(model, ids)
    # one e4m3 rounding per operand of every base GEMM (module docstring): the loss moves by far less than the
    # per-GEMM RMS error, the gradients by at most the MLP bound
    assert loss != exact_loss and abs(loss - exact_loss) <= 0.02 * abs(exact_loss)
    assert max(_rel(g, e) for g, e in zip(grads, exact_grads, strict=True)) <= 0.1
    dx_report = patch_model(
        model, fp8_base="dx"
    )  # the backward's copy alone: the forward, so the loss, exact
    assert all(fp8_of(w, BF16).w is None for w in bases)
    assert 2 * dx_report.fp8_bytes < report.fp8_bytes + 4 * sum(w.shape[0] for w in bases)
    assert any("FP8 dx GEMMs (forward exact) (opt-in, inexact) on 14" in n for n in dx_report.notes)
    dx_loss, dx_grads = _loss_and_grads(model, ids)
    assert dx_loss == exact_loss
    assert 0 < max(_rel(g, e) for g, e in zip(dx_grads, exact_grads, strict=True)) <= 0.1
    for wrong in ("fwd", 1):
        with pytest.raises(ValueError, match=f"fp8_base={wrong!r}"):
            patch_model(model, fp8_base=wrong)
    assert all(fp8_of(w, BF16).w is None for w in bases)  # refused before anything changed
    unpatch_model(model)
    assert all(fp8_of(w, BF16) is None for w in bases)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_bases_train_an_8b_shaped_layer_stack_like_the_exact_path():
    # 4 layers of Llama-3-8B's shape, bf16, fp32 adapters, 2 × 2048 tokens, 6 AdamW steps from the same start:
    # the FP8 runs' losses stay within 1% of the exact run's and fall as much; the dx-only run's first loss is
    # the exact run's (its forward is exact).
    transformers = locked("transformers")
    peft = locked("peft")
    from strop.kernels.models import patch_model

    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    ids = torch.randint(0, 32000, (2, 2048), generator=torch.Generator().manual_seed(2)).cuda()
    runs = []
    for fp8 in (False, True, "dx"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="sdpa", dtype=BF16
        ).cuda()
        lora = peft.LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
        patch_model(model, fp8_base=fp8)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        losses = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=BF16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append(losses)
        del model, opt
        torch.cuda.empty_cache()
    exact, *fp8_runs = runs
    assert exact[0] - exact[-1] > 0
    for fp8 in fp8_runs:
        assert all(abs(a - b) <= 0.01 * abs(b) for a, b in zip(fp8, exact, strict=True)), (fp8, exact)
        assert fp8[0] - fp8[-1] >= 0.9 * (exact[0] - exact[-1]), (fp8, exact)
    assert fp8_runs[1][0] == exact[0], runs


def test_an_empty_batch_runs_the_fp8_path_to_zero_adapter_gradients():
    p = _proj(48, 64)
    x = torch.randn(0, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    y = lora_linear(x, *p)
    d_x, d_a, d_b = torch.autograd.grad(y.sum(), [x, p[1], p[2]])  # dy of y.sum() over no rows: any strides
    assert y.shape == (0, 48) and d_x.shape == (0, 64)
    assert not d_a.abs().sum() and not d_b.abs().sum()
    detach_fp8(p[0])


def test_a_base_over_the_quantizers_row_limit_keeps_exact_gemms():
    from strop.kernels.lora.linear import fp8_reason
    from strop.kernels.ops.utils import MAX_FUSED_SIZE

    wide = torch.empty(16, 2 * MAX_FUSED_SIZE, dtype=BF16, device="meta")
    assert "longer than the quantizer's" in fp8_reason(wide)


def test_merging_the_adapter_drops_the_copies_of_the_unmerged_base():
    from strop.kernels.models import patch_model, unpatch_model

    model = _tiny_llama()
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    patch_model(model, fp8_base=True)
    model.merge_adapter()  # PEFT writes B·A·s into each base weight in place

    def logits():
        with torch.no_grad(), torch.autocast(DEVICE, dtype=BF16):
            return model(input_ids=ids, use_cache=False).logits.float()

    patched = logits()  # copies of the unmerged bases would drop every adapter's term (~1.4 relative off)
    unpatch_model(model)
    assert _rel(patched, logits()) <= 0.02
    assert all(fp8_of(m.weight, BF16) is None for n, m in model.named_modules() if n.endswith("base_layer"))
