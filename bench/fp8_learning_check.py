"""How much of a step's learning the FP8 base GEMMs' definition keeps, in plain torch on the CPU (no strop kernel).

``patch_model(fp8_base=True)`` computes, per frozen base, y = deq(Q(x)) deq(Q(W))ᵀ and dx = deq(Q(dy)) deq(Q(Wᵀ))ᵀ
(``kernels/ops/fp8.py``; tests/kernels/ops/test_fp8.py checks the kernels against that definition). This script trains
one random Llama-shaped model with PEFT LoRA four times from the same start — exact, both GEMMs fake-quantized,
forward only, backward only (``quantize_rows_reference``, fp32 arithmetic otherwise) — and prints each run's loss
drop as a share of the exact run's. ``--init`` sets the weights' std: 0.02 at width 512 gives each projection
outputs ~√(4096/512) smaller than an 8B-width model's at 0.02; 0.0566 matches the 8B's per-layer gain.

    python3 bench/fp8_learning_check.py --layers 32 --init 0.0566     # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse

import peft
import torch
import transformers

from strop.kernels.ops.fp8 import quantize_rows_reference

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _deq(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_rows_reference(x)
    return (q.float() * s).to(x.dtype)


class _FakeFp8Linear(torch.autograd.Function):
    """x Wᵀ with the FP8 path's rounding in the forward and/or the backward's dx (W is frozen: no dW)."""

    @staticmethod
    def forward(ctx, x, w, fwd: bool, bwd: bool):
        ctx.save_for_backward(w)
        ctx.bwd = bwd
        x2 = x.reshape(-1, x.shape[-1])
        y = _deq(x2) @ _deq(w).t() if fwd else x2 @ w.t()
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        d2 = dy.reshape(-1, dy.shape[-1])
        dx = _deq(d2) @ _deq(w.t().contiguous()).t() if ctx.bwd else d2 @ w
        return dx.reshape(*dy.shape[:-1], w.shape[1]), None, None, None


def train(a, fwd: bool, bwd: bool) -> list[float]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=a.width,
        intermediate_size=3 * a.width,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=a.seq,
        tie_word_embeddings=False,
        initializer_range=a.init,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    if fwd or bwd:
        for mod in model.modules():
            if isinstance(mod, peft.tuners.lora.Linear):
                base = mod.base_layer
                base.forward = lambda x, b=base: _FakeFp8Linear.apply(x, b.weight, fwd, bwd)
    ids = torch.randint(0, 4096, (2, a.seq), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses = []
    for _ in range(a.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--init", type=float, default=0.0566)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    runs = {
        "exact": (False, False),
        "FP8 both": (True, True),
        "FP8 forward": (True, False),
        "FP8 dx": (False, True),
    }
    print(f"{a.layers} layers, width {a.width}, init std {a.init}, 2 × {a.seq} tokens, {a.steps} AdamW steps")
    print("| run | first loss | last loss | drop | share of exact |\n|---|---:|---:|---:|---:|")
    drop0 = None
    for name, (fwd, bwd) in runs.items():
        losses = train(a, fwd, bwd)
        drop = losses[0] - losses[-1]
        drop0 = drop0 or drop
        print(
            f"| {name} | {losses[0]:.5f} | {losses[-1]:.5f} | {drop:.5f} | {drop / drop0:.3f} |", flush=True
        )


if __name__ == "__main__":
    main()
