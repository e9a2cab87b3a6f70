"""An MoE layer's experts on the grouped GEMM (``kernels/lora/moe.py``) under torch's non-reentrant checkpoint.

The layer's last saved tensor is the down projection's input (``moe_lora_gemm(split=True)``: its first node saves it
and computes nothing; the product node, which computes the down product and u = h·Aᵀ, and the sum of each token's
rows save none), so the recompute stops there: its only grouped GEMM is the gate/up product (two fewer than with the
early stop off: the down product and u), it sums no rows, and every gradient is the same as without checkpointing,
bit for bit (the same ops on the same values; fp32 on the CPU, the kernels under the interpreter).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tests.kernels._tolerances import cpu_tier

pytestmark = cpu_tier

T, H, N_I, E, K, R = 11, 64, 32, 5, 2, 4


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    gu = torch.randn(E, 2 * N_I, H, generator=gen) / H**0.5
    dn = torch.randn(E, H, N_I, generator=gen) / N_I**0.5
    factors = [
        torch.randn(E, R, H, generator=gen) / H**0.5,
        torch.randn(E, 2 * N_I, R, generator=gen) / R**0.5,
    ]
    factors += [
        torch.randn(E, R, N_I, generator=gen) / N_I**0.5,
        torch.randn(E, H, R, generator=gen) / R**0.5,
    ]
    dy = torch.randn(T, H, generator=gen)
    return x, idx, w, gu, dn, factors, dy


def _grads(run):
    x, idx, w, gu, dn, factors, dy = _inputs()
    leaves = [t.requires_grad_() for t in (x, w, *factors)]
    a1, b1, a2, b2 = factors
    run(x, idx, w, (gu, a1, b1, 0.5), (dn, a2, b2, 0.5)).backward(dy)
    return [t.grad for t in leaves]


def test_the_checkpointed_recompute_stops_before_the_down_product_and_the_gradients_are_unchanged(
    monkeypatch,
):
    from strop.kernels.lora import moe
    from strop.kernels.ops import moe_gemm, moe_rows

    calls = {"gemm": 0, "sum": 0}
    gemm, sum_rows = moe_gemm.grouped_mm, moe_rows.sum_rows

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(moe_gemm, "grouped_mm", counted("gemm", gemm))
    monkeypatch.setattr(moe_rows, "sum_rows", counted("sum", sum_rows))
    plain = _grads(moe.lora_moe_experts)
    counts = {"plain": dict(calls)}
    for early in (True, False):
        calls.update(gemm=0, sum=0)
        with set_checkpoint_early_stop(early):  # read when the forward runs
            got = _grads(lambda *args: checkpoint(moe.lora_moe_experts, *args, use_reentrant=False))
        counts[early] = dict(calls)
        for name, g, want in zip(
            ("dx", "dw", "dA gate_up", "dB gate_up", "dA down", "dB down"), got, plain, strict=True
        ):
            assert torch.equal(g, want), f"early stop {early}: {name}"
    recomputed = {k: {n: c[n] - counts["plain"][n] for n in c} for k, c in counts.items() if k != "plain"}
    assert recomputed[True] == {"gemm": 1, "sum": 0}, recomputed  # the gate/up product only
    assert recomputed[False] == {"gemm": 3, "sum": 1}, recomputed  # and the down product, u, the row sum


def test_a_checkpointed_layers_backward_reads_the_gate_up_stack_its_recompute_merged(monkeypatch):
    """The recompute merges the gate/up stack just before its backward needs it (the down projection's backward ran
    first, before the recompute): that backward reads it from the shared buffer although autograd hands it the
    recompute's saved factors as other tensor objects, so the layer's backward merges two stacks (down, and gate/up
    once), not three; every gradient is the uncheckpointed one, bit for bit."""
    from strop.kernels.lora import moe
    from strop.kernels.ops import moe_gemm, nf4

    merged = []
    real = moe_gemm._merge_into
    monkeypatch.setattr(
        moe_gemm, "_merge_into", lambda out, w, *rest: merged.append(w.shape) or real(out, w, *rest)
    )
    plain = _grads(moe.lora_moe_experts)

    def layer(x, idx, w, gate_up, down):
        y = checkpoint(moe.lora_moe_experts, x, idx, w, gate_up, down, use_reentrant=False)
        # what the layers after this one do between its forward and its backward: take the buffer's two slots
        nf4._shared_buffer(x.device, x.dtype, 1).zero_()
        nf4._shared_buffer(x.device, x.dtype, 1, slot=1).zero_()
        merged.clear()
        return y

    gu_shape, down_shape = (E, 2 * N_I, H), (E, H, N_I)
    with set_checkpoint_early_stop(True):
        got = _grads(layer)
    assert merged == [down_shape, gu_shape], (
        f"the backward merged {merged}: down once, gate/up once (recompute)"
    )
    for name, g, want in zip(
        ("dx", "dw", "dA gate_up", "dB gate_up", "dA down", "dB down"), got, plain, strict=True
    ):
        assert torch.equal(g, want), name
