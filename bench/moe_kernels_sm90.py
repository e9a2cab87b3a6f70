"""Compile the MoE router's, routing plan's and expert-stack merge's Triton kernels for sm_90 (H100/H200) without a
GPU: every variant the default training path launches (Qwen3-MoE and Mixtral shapes, bf16 and fp32 sessions,
long-context scan steps; each merge tile the autotuner may keep, NF4 and 16-bit stacks), through Triton's own
compiler and ptxas, and print each kernel's registers, spills (local memory) and SASS length.

What it shows: the kernels compile for the GPU the benchmarks run on and do not spill; not that they are correct
there (their ``-m gpu`` tests) nor how fast they are (``bench/moe_router_bench.py``).

Usage (any machine with this venv's Triton; no GPU, no TRITON_INTERPRET)::

    python bench/moe_kernels_sm90.py
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

_DT = {"bf16": "*bf16", "fp32": "*fp32", "i64": "*i64", "i32": "*i32"}


def _compile(kern, sig: dict, consts: dict, warps: int, aligned=(), **options) -> str:
    """``aligned``: the arguments specialized as multiples of 16 (pointers, sizes, strides), as Triton specializes
    them at launch; ``options``: compile options beyond the warps (the merge's ``enable_fp_fusion=False``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    names = kern.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    consts = {(names.index(n),): v for n, v in consts.items()}
    c = triton.compile(
        ASTSource(fn=kern, signature={n: sig[n] for n in names}, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, **options},
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path("/tmp") / f"{kern.fn.__name__}-{os.getpid()}.cubin"
    cubin.write_bytes(c.asm["cubin"])
    use = subprocess.run(
        [str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    sass = subprocess.run(
        [str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
    ).stdout
    cubin.unlink()
    regs = re.search(r"REG:(\d+)", use)
    local = re.search(r"LOCAL:(\d+)", use)
    n = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
    return f"regs {regs.group(1) if regs else '?'} local {local.group(1) if local else '?'} sass {n}"


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    from strop.kernels.ops import moe_router as r
    from strop.kernels.ops import moe_routing as m
    from strop.kernels.ops.utils import ROW_TILE, cdiv, next_power_of_2

    print("sm_90 compile (Triton + ptxas, no GPU)", flush=True)
    # (what, experts, k, normalize, logits dtype, weights dtype)
    routers = [
        ("qwen3-30b-a3b bf16", 128, 8, True, "bf16", "bf16"),
        ("qwen3-moe norm_topk_prob false", 128, 8, False, "bf16", "bf16"),
        ("mixtral-8x7b bf16 (fp32 weights)", 8, 2, True, "bf16", "fp32"),
        ("qwen3-30b-a3b fp32 session", 128, 8, True, "fp32", "fp32"),
    ]
    for what, e, k, norm, ldt, wdt in routers:
        block_e = next_power_of_2(e)
        consts = dict(
            K=k,
            NORMALIZE=norm,
            BLOCK_T=max(1, ROW_TILE // block_e),
            BLOCK_E=block_e,
            BLOCK_K=max(2, next_power_of_2(k)),
        )
        fwd = dict(l_ptr=_DT[ldt], w_ptr=_DT[wdt], idx_ptr="*i64", T="i32", E="i32", stride="i32")
        bwd = dict(
            l_ptr=_DT[ldt], idx_ptr="*i64", dw_ptr=_DT[wdt], dl_ptr=_DT[ldt], T="i32", E="i32", stride="i32",
            dl_stride="i32",
        )  # fmt: skip
        print(f"router {what}: fwd {_compile(r._router_fwd_kernel, fwd, consts, r._NUM_WARPS)}", flush=True)
        print(f"router {what}: bwd {_compile(r._router_bwd_kernel, bwd, consts, r._NUM_WARPS)}", flush=True)
    # (what, experts, k, weights dtype, plan weights dtype, tokens)
    plans = [
        ("qwen3-30b-a3b 8 x 2048 bf16", 128, 8, "bf16", "bf16", 8 * 2048),
        ("qwen3-30b-a3b 131,072 tokens", 128, 8, "bf16", "bf16", 131072),
        ("mixtral-8x7b bf16 (fp32 weights)", 8, 2, "fp32", "bf16", 8 * 2048),
        ("qwen3-30b-a3b fp32 session", 128, 8, "fp32", "fp32", 8 * 2048),
    ]
    for what, e, k, wdt, sdt, t in plans:
        nb = max(1, cdiv(t * k, m._BLOCK))
        block_e = max(2, next_power_of_2(e))
        block_nb = min(m._SCAN_CHUNK, next_power_of_2(nb))
        counts = _compile(
            m._counts_kernel,
            dict(idx_ptr="*i64", counts_ptr="*i32", N="i32", E="i32"),
            dict(BLOCK=m._BLOCK, BLOCK_E=block_e),
            m._NUM_WARPS,
        )
        scan = _compile(
            m._scan_kernel,
            dict(counts_ptr="*i32", before_ptr="*i32", total_ptr="*i32", NB="i32", E="i32"),
            dict(BLOCK_NB=block_nb, CHUNKS=cdiv(nb, block_nb)),
            m._NUM_WARPS,
        )
        place = _compile(
            m._place_kernel,
            dict(
                idx_ptr="*i64",
                w_ptr=_DT[wdt],
                before_ptr="*i32",
                total_ptr="*i32",
                offsets_ptr="*i32",
                inv_ptr="*i64",
                token_ptr="*i64",
                ws_ptr=_DT[sdt],
                N="i32",
                E="i32",
            ),
            dict(K=k, BLOCK=m._BLOCK, BLOCK_E=block_e),
            m._NUM_WARPS,
        )
        print(f"routing plan {what}: counts {counts}; scan {scan}; place {place}", flush=True)
    merge_tiles()


def merge_tiles() -> None:
    """``moe_gemm._merge_kernel`` for each tile the autotuner may keep (BLOCK_N x BLOCK_K x warps, a byte's codes
    from the pair table or the code book), Qwen3-30B-A3B's stacks (rank 16, bf16): NF4 double-quantized codes whose
    rows are whole blocks (each block's scale once a tile row), and a 16-bit stack."""
    import triton.language as tl

    from strop.kernels.ops import moe_gemm as g
    from strop.kernels.ops.small_k import block_k

    tables = ("absmax_ptr", "absmax2_ptr", "code2_ptr", "offset_ptr", "code_ptr", "pairs_ptr")
    sizes = ("N", "K", "R", "b_se", "b_sn", "b_sr", "a_se", "a_sr", "a_sk", "w_se", "w_sn", "w_sk")
    for nf4 in (True, False):
        sig = dict(
            w_ptr="*u8" if nf4 else "*bf16",
            absmax_ptr="*u8" if nf4 else "*bf16",
            **{t: "*fp32" if nf4 else "*bf16" for t in tables[1:]},
            b_ptr="*bf16",
            a_ptr="*bf16",
            out_ptr="*bf16",
            scale="fp32",
            **dict.fromkeys(sizes, "i32"),
        )
        for n, k, warps, pairs, k_tiles in g._MERGE_TILES:
            consts = dict(
                NF4=nf4, HALF_BS=g.NF4_BLOCKSIZE // 2 if nf4 else 1, NESTED=nf4, BS2=256 if nf4 else 1,
                ROW_BLOCKS=nf4, QDTYPE=tl.bfloat16, OUT_DTYPE=tl.bfloat16, IEEE=False, BLOCK_N=n, BLOCK_K=k,
                BLOCK_R=block_k(16), PAIRS=pairs, K_TILES=k_tiles,
            )  # fmt: skip
            aligned = (
                "w_ptr",
                *tables,
                "b_ptr",
                "a_ptr",
                "out_ptr",
                "N",
                "K",
                "R",
                "b_se",
                "b_sn",
                "a_se",
                "a_sr",
            )
            got = _compile(g._merge_kernel, sig, consts, warps, aligned, enable_fp_fusion=False)
            lookup = "pairs" if pairs else "book"
            looped = f", {k_tiles} tiles looped" if k_tiles > 1 else ""
            print(f"merge {'NF4' if nf4 else '16-bit'} {n}x{k}x{warps} {lookup}{looped}: {got}", flush=True)


if __name__ == "__main__":
    main()
