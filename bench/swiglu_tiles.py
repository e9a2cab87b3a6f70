"""SwiGLU forward and backward with and without LoRA terms, at the 8B MLP's shape: a tile and warp sweep.

    python bench/swiglu_tiles.py

The fused LoRA MLP hands the activation kernels the base gate/up outputs and the adapters' rank-16 terms
(``swiglu.LowRank``), which each kernel adds with one ``tl.dot`` per tile. Prediction: with the best tile the
forward stays at the cost of its memory traffic (read gate, up; write h: 3 · 470 MB at 16,384 × 14,336 bf16) and
the backward at its own (read dh, gate, up; write dgate, dup, h: 6 · 470 MB), terms or no terms, i.e. ≥ 80% of
copy bandwidth; the separate updates they replace cost 0.26 ms each (``bench/small_k.py``). Prints a table; checks
each configuration against fp32 torch once.
"""

from __future__ import annotations

import importlib
import itertools

import torch
import triton.testing

sw = importlib.import_module("strop.kernels.ops.swiglu")  # the package exports a function of the same name

M, N, R = 16384, 14336, 16
TILES = [(16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]


def term(seed: int, k: int = R) -> sw.LowRank:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, 2 * k, device="cuda", generator=gen, dtype=torch.bfloat16)[:, :k]  # u_gu's half
    b = (0.05 * torch.randn(N, k, device="cuda", generator=gen)).to(torch.bfloat16).t()  # lora_B.t()
    return sw.LowRank(a, b, 2.0)


def copy_tbps() -> float:
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9


def main() -> None:
    copy = copy_tbps()
    g, u, dh = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    gt, ut, dt = term(1), term(2), term(3)
    h, h2 = torch.empty_like(g), torch.empty_like(g)
    ge = g.float() + gt.scale * (gt.a.float() @ gt.b.float())
    ue = u.float() + ut.scale * (ut.a.float() @ ut.b.float())
    ref_h = torch.nn.functional.silu(ge).to(torch.bfloat16).float() * ue
    del ge, ue
    nbytes = g.numel() * g.element_size()
    print(f"GPU {torch.cuda.get_device_name(0)}; copy {copy:.2f} TB/s; [{M}, {N}] bf16, rank {R}")
    print(
        "| tile | warps | fwd ms | fwd+terms ms | bwd ms | bwd+terms ms | fwd+terms % copy | bwd+terms % copy | max |Δh| |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    best = None
    for (bm, bn), warps in itertools.product(TILES, (4, 8)):
        sw._BLOCK_M, sw._BLOCK_N, sw._NUM_WARPS = bm, bn, warps
        try:
            sw.swiglu_fwd(g, u, h, gate_term=gt, up_term=ut)
            err = (h.float() - ref_h).abs().max().item()
            t = {}
            t["f"] = triton.testing.do_bench(lambda: sw.swiglu_fwd(g, u, h), return_mode="median")
            t["ft"] = triton.testing.do_bench(
                lambda: sw.swiglu_fwd(g, u, h, gate_term=gt, up_term=ut), return_mode="median"
            )
            t["b"] = triton.testing.do_bench(
                lambda: sw._glu_bwd(dh, g, u, sw._SILU, False, h2), return_mode="median"
            )
            t["bt"] = triton.testing.do_bench(
                lambda: sw._glu_bwd(dh, g, u, sw._SILU, False, h2, gt, ut, dt), return_mode="median"
            )
        except Exception as exc:  # a tile the compiler cannot fit
            print(f"| {bm}×{bn} | {warps} | {type(exc).__name__}: {str(exc)[:60]} | | | | | | |")
            continue
        fp, bp = 3 * nbytes / t["ft"] / 1e9 / copy, 6 * nbytes / t["bt"] / 1e9 / copy
        if err < 0.1 and (best is None or 2 * t["ft"] + t["bt"] < best[0]):  # a layer: 2 forwards, 1 backward
            best = (2 * t["ft"] + t["bt"], f"{bm}x{bn}x{warps}")
        print(
            f"| {bm}×{bn} | {warps} | {t['f']:.3f} | {t['ft']:.3f} | {t['b']:.3f} | {t['bt']:.3f} | "
            f"{100 * fp:.0f} | {100 * bp:.0f} | {err:.2e} |"
        )
    if best is not None:
        print(
            f"best (2 forwards + 1 backward with terms, {best[0]:.3f} ms): {best[1]} (BLOCK_M x BLOCK_N x warps)"
        )


if __name__ == "__main__":
    main()
