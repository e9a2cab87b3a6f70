"""HostAdamW (``kernels/models/host_adamw.py``): AdamW with its moments in host memory, streamed through the device
in chunks, against ``torch.optim.AdamW`` holding everything in memory.

Expected: bitwise equal parameters, moments and step counters after every step. Both run torch's own AdamW update
and AdamW is elementwise within a parameter with per-parameter counters, so chunking the parameters cannot change a
bit; any difference is a moment read before its copy landed, written to the wrong parameter or left stale. On the
CPU host and "device" are both the CPU (the same schedule, synchronous copies); the GPU test runs the side streams
and pinned memory.
"""

from __future__ import annotations

import copy

import pytest
import torch

from strop.kernels.models.host_adamw import HostAdamW


def _params(device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # a LoRA-like mix: matrices of several sizes, a vector, a transposed (non-contiguous but dense) one
    shapes = [(64, 48), (16, 300), (300, 16), (7,), (128, 128), (3, 5)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    ps.append(torch.nn.Parameter(torch.randn(40, 24, generator=g).t().to(device)))
    return ps


def _grads(params, step: int, skip: int | None) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g).to(p.device) * (1 + i) for i, p in enumerate(params)]
    if skip is not None:  # a parameter without a gradient this step: skipped by both (its counter too)
        out[skip] = None
    return out


def _groups(params, amsgrad: bool):
    return [
        {"params": params[:4], "weight_decay": 0.1},
        {"params": params[4:], "weight_decay": 0.0, "amsgrad": amsgrad},
    ]


def _run(opt, params, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        skip = 2 if step == 1 else (5 if step == 3 else None)
        for p, g in zip(params, _grads(params, step, skip), strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()


def _assert_same(ref_opt, ref_params, opt, params) -> None:
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs by {(a - b).abs().max()}"
        sa, sb = ref_opt.state[a], opt.state[b]
        assert sorted(sa) == sorted(sb), (i, sorted(sa), sorted(sb))
        for k in sa:
            assert torch.equal(sa[k], sb[k].to(sa[k].device)), f"parameter {i}'s {k} differs"


@pytest.mark.parametrize(
    "foreach,amsgrad,chunk_bytes",
    [(None, False, 4096), (True, False, 4096), (False, True, 1 << 20), (True, True, 1)],
    ids=["default-small-chunks", "foreach", "single-one-chunk-amsgrad", "foreach-chunk-per-param-amsgrad"],
)
def test_host_adamw_matches_torch_adamw_bit_for_bit_on_cpu(foreach, amsgrad, chunk_bytes):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=foreach)
    ref_params, params = _params("cpu"), _params("cpu")
    ref = torch.optim.AdamW(_groups(ref_params, amsgrad), **kw)
    opt = HostAdamW(_groups(params, amsgrad), chunk_bytes=chunk_bytes, **kw)
    for step in range(5):
        _run(ref, ref_params, 1, step)
        _run(opt, params, 1, step)
        _assert_same(ref, ref_params, opt, params)
    # every parameter's moments pass 4 KiB (a chunk each); 1 MiB holds a whole group
    assert len([c for g in opt.param_groups for c in opt._chunks(g)]) == (2 if chunk_bytes == 1 << 20 else 7)
    # the moments are the optimizer's own host tensors, not views of the streaming buffers
    bufs = {b.untyped_storage().data_ptr() for bs in opt._buffers.values() for b in bs}
    assert bufs and not any(
        v.untyped_storage().data_ptr() in bufs for s in opt.state.values() for v in s.values()
    )


def test_host_adamw_state_dict_round_trips_with_torch_adamw():
    """A HostAdamW checkpoint resumes in torch's AdamW and the other way round, bit for bit."""
    kw = dict(lr=3e-3, weight_decay=0.01)
    ref_params, params = _params("cpu", 1), _params("cpu", 1)
    ref = torch.optim.AdamW(ref_params, **kw)
    opt = HostAdamW(params, chunk_bytes=8192, **kw)
    _run(ref, ref_params, 3)
    _run(opt, params, 3)
    p2, r2 = (
        [torch.nn.Parameter(p.detach().clone()) for p in params],
        [torch.nn.Parameter(p.detach().clone()) for p in ref_params],
    )
    from_host = torch.optim.AdamW(r2, **kw)
    # deep copies: torch's load keeps the step counters' tensors as given, so two optimizers would share them
    from_host.load_state_dict(copy.deepcopy(opt.state_dict()))
    from_torch = HostAdamW(p2, chunk_bytes=8192, **kw)
    from_torch.load_state_dict(copy.deepcopy(ref.state_dict()))
    _run(ref, ref_params, 2, 3)
    _run(from_host, r2, 2, 3)
    _run(from_torch, p2, 2, 3)
    _assert_same(ref, ref_params, from_host, r2)
    _assert_same(ref, ref_params, from_torch, p2)


def test_host_adamw_refuses_what_it_cannot_stream():
    with pytest.raises(ValueError, match="chunk_bytes"):
        HostAdamW(_params("cpu"), chunk_bytes=0)
    with pytest.raises(ValueError, match="capturable"):
        HostAdamW(_params("cpu"), capturable=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("foreach", [None, False])
def test_host_adamw_on_cuda_matches_torch_adamw_and_holds_no_moments_on_the_device(foreach):
    """On CUDA: pinned host moments, two side streams; bitwise torch's AdamW on the device after every step. The
    device keeps only the two chunk buffers between steps; within a step it holds the buffers, at most two chunks'
    new moments (the first step's, on their way to the host) and one chunk's temporaries: under torch's moments."""
    kw = dict(lr=1e-3, betas=(0.9, 0.999), foreach=foreach)
    chunk = 32 << 20
    g = torch.Generator().manual_seed(0)
    # LoRA factors of a 30B-A3B MoE layer (128 experts x r 16: A [2048, 2048] of gate/up, B [1536, 2048], the down
    # pair) and of attention, twice: 105 MB of fp32 factors, 210 MB of moments
    shapes = [(2048, 2048), (1536, 2048), (2048, 768), (2048, 2048), (16, 2048), (4096, 16)] * 2
    host = [torch.randn(s, generator=g) for s in shapes]
    ref_params = [torch.nn.Parameter(t.cuda()) for t in host]
    params = [torch.nn.Parameter(t.cuda()) for t in host]
    moments = 2 * sum(t.numel() * 4 for t in host)
    ref = torch.optim.AdamW(ref_params, **kw)
    opt = HostAdamW(params, chunk_bytes=chunk, **kw)
    for step in range(4):
        gs = [torch.randn(s, generator=g).cuda() for s in shapes]
        for p, q, gr in zip(ref_params, params, gs, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees what waits on a side stream's use (record_stream) once that use is done
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.synchronize()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        peak, kept = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
        # a chunk's moments are at most 32 MiB (the largest factor's two moments: exactly one chunk)
        assert peak <= 2 * chunk + 2 * chunk + chunk < moments, f"step {step}: {peak / 2**20:.1f} MiB"
        assert kept == (2 * chunk if step == 0 else 0), f"step {step}: {kept / 2**20:.1f} MiB kept"
        _assert_same(ref, ref_params, opt, params)
        assert all(
            v.device.type == "cpu" and v.is_pinned()
            for s in opt.state.values()
            for v in s.values()
            if v.dim()
        )
