"""Host time per call of strop's ops at sizes where the GPU work is negligible (issue 15's "fewer launches" lever).

At a 1B shape strop's training step waits on the host (bench/RESULTS.md, session 7: 410 ms a step against 287 ms
of GPU work). This times each op on inputs small enough that its kernels take a few microseconds, so the wall time
per call is the host's: Python checks, allocations, autograd bookkeeping and Triton launches. For each op:
µs/call of strop's autograd forward, of forward + backward, and of the same computation in plain torch (HF's
modules) for scale; plus an empty Triton kernel's launch and an empty ``torch.autograd.Function`` as floors.

Usage (on the GPU machine): ``python3 bench/host_overhead.py [--calls 2000]``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):  # compile and warm the caches
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    from strop.kernels.lora.linear import lora_linear
    from strop.kernels.ops.rmsnorm import RMSNormMode, rms_norm

    dev, dt = "cuda", torch.bfloat16
    h, r, rows = 256, 16, 8
    x = torch.randn(rows, h, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(h, device=dev, dtype=dt)
    base = torch.randn(h, h, device=dev, dtype=dt)
    lora_a = torch.randn(r, h, device=dev, dtype=torch.float32, requires_grad=True)
    lora_b = torch.randn(h, r, device=dev, dtype=torch.float32, requires_grad=True)
    g = torch.randn(rows, h, device=dev, dtype=dt)
    buf = torch.zeros(1024, device=dev)

    def hf_norm(x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(v + 1e-6)).to(dt)

    def hf_lora(x):
        with torch.autocast("cuda", dtype=dt):
            return torch.nn.functional.linear(x, base) + 2.0 * torch.nn.functional.linear(
                torch.nn.functional.linear(x, lora_a), lora_b
            )

    def fwd_bwd(f):
        def run():
            f(x).backward(g)

        return run

    ops = {
        "rms_norm (LLAMA)": (lambda x: rms_norm(x, w), hf_norm),
        "rms_norm (GEMMA)": (lambda x: rms_norm(x, w, mode=RMSNormMode.GEMMA), hf_norm),
        "lora_linear": (lambda x: lora_linear(x, base, lora_a, lora_b, 2.0), hf_lora),
    }
    rows_out = [
        "| op | strop fwd µs | strop fwd+bwd µs | torch fwd µs | torch fwd+bwd µs |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (ours, ref) in ops.items():
        with torch.no_grad():
            f_ours = per_call_us(functools.partial(ours, x), a.calls)
            f_ref = per_call_us(functools.partial(ref, x), a.calls)
        fb_ours, fb_ref = per_call_us(fwd_bwd(ours), a.calls), per_call_us(fwd_bwd(ref), a.calls)
        rows_out.append(f"| {name} | {f_ours:.1f} | {fb_ours:.1f} | {f_ref:.1f} | {fb_ref:.1f} |")
    launch = per_call_us(lambda: _empty_kernel[(1,)](buf, 1024, BLOCK=1024), a.calls)
    ident = per_call_us(fwd_bwd(_Identity.apply), a.calls)
    rows_out.append(f"| floor: empty Triton launch | {launch:.1f} | | | |")
    rows_out.append(f"| floor: identity autograd.Function fwd+bwd | | {ident:.1f} | | |")
    print(
        f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
        f"inputs [{rows}, {h}] {dt}, {a.calls} calls each"
    )
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
