"""AdamW whose moments live in host memory: ZeRO-Offload's placement of the optimizer state, for one device.

torch's AdamW keeps two fp32 moments of every trainable element on the parameters' device, 8 bytes an element beside
the 4 of the fp32 adapter and the 4 of its gradient. LoRA r 16 on every expert of a 128-expert, 48-layer MoE is
~0.64 B elements: ~4.8 GiB of moments, and torch's grouped (foreach) update adds a temporary as large as one moment.
:class:`HostAdamW` keeps the moments in pinned host memory and streams them through the device for each update, a
chunk of parameters at a time, on two side streams and two device buffers that alternate::

    copy-in stream    in(0) in(1)          in(2)          in(3) ...      in(j) waits for out(j-2): same buffer
    compute stream          adam(0) adam(1)        adam(2)        ...    adam(i) waits for in(i)
    copy-out stream                 out(0)  out(1)         out(2) ...    out(i) waits for adam(i)

The update of a chunk is torch's own AdamW step (the body of ``AdamW.step``: ``_init_group`` and the functional update
with the group's foreach / fused choice) over the chunk's parameters, the moments swapped for their device copies.
AdamW is elementwise within each parameter and its step counters are per parameter, so parameters, moments and
counters are bitwise those of ``torch.optim.AdamW`` holding everything on the device. Parameters and gradients stay
where they are; the step counters stay where torch keeps them (host scalars). The device holds the two buffers
(``2 · chunk_bytes``) instead of the moments, and a chunk's temporaries instead of the whole group's.

A parameter's first moments are torch's own, created on the device inside its chunk's update and copied out; the
host waits for the copy-out two chunks back first, so a first step holds at most two chunks of them.

Who uses it: the trainer, for a single-process job whose AdamW fits only with its moments in host memory
(``trainer_svc/core/admission.py``); ``bench/moe_bench.py --host-adam``.

The same schedule runs on CPU tensors (host and "device" both the CPU, copies synchronous): the CPU tier checks it
against ``torch.optim.AdamW`` bit for bit.

Costs: each step copies the moments to the device and back (16 bytes an element over the host link); the copies
overlap the chunks' updates, not the forward and backward.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "HostAdamW", "host_adamw_device_bytes"]

# One chunk's moments; the device holds two such buffers. A few dozen chunks keep each copy long enough to run at
# the link's speed and the two buffers small beside the adapter.
DEFAULT_CHUNK_BYTES = 64 << 20
# each moment's view starts on a 256-byte boundary of its buffer (the vectorized kernels' alignment)
_ALIGN = 256

# torch's AdamW update, without the step hooks (they run once, around HostAdamW.step) and grad-mode wrappers
_ADAM_STEP = inspect.unwrap(torch.optim.AdamW.step)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def host_adamw_device_bytes(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The device memory :class:`HostAdamW` holds between steps: its two chunk buffers (a parameter whose moments
    pass ``chunk_bytes`` widens them to its size)."""
    return 2 * chunk_bytes


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, same state and ``state_dict``) with its moments in host memory.

    Args:
        params: As ``torch.optim.AdamW``'s.
        chunk_bytes: The moments' bytes of one chunk of parameters (a larger parameter is a chunk of its own).
        **kwargs: ``torch.optim.AdamW``'s (lr, betas, eps, weight_decay, amsgrad, foreach, fused, ...).
    """

    def __init__(self, params, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if kwargs.get("capturable") or kwargs.get("differentiable"):
            raise ValueError("HostAdamW: capturable and differentiable updates are not supported")
        super().__init__(params, **kwargs)
        self.chunk_bytes = chunk_bytes
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._copies_done: torch.cuda.Event | None = None  # the last copy-out of the last step

    # -- what a parameter's state holds

    @staticmethod
    def _moments(p: torch.Tensor, state: dict) -> list[str]:
        """The state entries shaped like ``p`` (exp_avg, exp_avg_sq, max_exp_avg_sq): what lives on the host."""
        return [
            k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape
        ]

    def _moment_bytes(self, p: torch.Tensor, group: dict) -> int:
        # a parameter without state yet gets torch's two moments (three with amsgrad) in its own dtype
        k = len(self._moments(p, self.state[p])) or (3 if group["amsgrad"] else 2)
        return k * _aligned(p.numel() * p.element_size())

    def _chunks(self, group: dict) -> list[list[torch.Tensor]]:
        chunks: list[list[torch.Tensor]] = []
        size = 0
        for p in group["params"]:
            if p.grad is None:
                continue
            n = self._moment_bytes(p, group)
            if not chunks or size + n > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += n
        return chunks

    # -- device buffers, streams

    def _device_buffers(self, device: torch.device, nbytes: int) -> list[torch.Tensor]:
        bufs = self._buffers.get(device)
        if bufs is None or bufs[0].numel() < nbytes:
            if bufs is not None and device.type == "cuda":  # the old buffers are freed on the compute stream
                torch.cuda.current_stream(device).wait_stream(self._side_streams(device)[1])
            bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
            self._buffers[device] = bufs
        return bufs

    def _side_streams(self, device: torch.device):
        if device.type != "cuda":
            return None, None
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def synchronize(self) -> None:
        """Wait until the last step's moments are in host memory (before reading them on the host)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    # -- the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs = [(group, chunk) for group in self.param_groups for chunk in self._chunks(group)]
        if not jobs:
            return loss
        device = jobs[0][1][0].device
        if any(p.device != device for _, chunk in jobs for p in chunk):
            raise ValueError("HostAdamW: every parameter with a gradient must be on one device")
        width = max(sum(self._moment_bytes(p, group) for p in chunk) for group, chunk in jobs)
        bufs = self._device_buffers(device, max(width, self.chunk_bytes))
        copy_in, copy_out = self._side_streams(device)
        compute = torch.cuda.current_stream(device) if copy_in is not None else None
        if copy_in is not None:
            copy_in.wait_stream(compute)  # the gradients' producers; the buffers' readers of the last step
            copy_in.wait_stream(copy_out)  # the host moments are the last step's copy-outs
        staged: list[dict] = [{} for _ in jobs]  # per chunk: (param, key) -> (device view, host tensor)
        ready: list[torch.cuda.Event | None] = [None] * len(jobs)
        written: list[torch.cuda.Event | None] = [None] * len(jobs)

        def stage(j: int) -> None:
            """Start copying chunk j's moments into buffer j % 2, once the copy-out that last read it is done."""
            buf, off = bufs[j % 2], 0
            with _on(copy_in):
                if copy_in is not None and j >= 2:
                    copy_in.wait_event(written[j - 2])
                for p in jobs[j][1]:
                    state = self.state[p]
                    for k in self._moments(p, state):
                        host = state[k]
                        dev = _carve(buf, off, host)
                        dev.copy_(host, non_blocking=True)
                        staged[j][(p, k)] = (dev, host)
                        off += _aligned(host.numel() * host.element_size())
                if copy_in is not None:
                    ready[j] = torch.cuda.Event()
                    ready[j].record(copy_in)

        stage(0)
        for i, (group, chunk) in enumerate(jobs):
            if i + 1 < len(jobs):
                stage(i + 1)
            if compute is not None:
                compute.wait_event(ready[i])
                if i >= 2 and any(not self.state[p] for p in chunk):
                    # torch creates a parameter's first moments on the device; the host waits for the copy-out
                    # two chunks back, so at most two chunks' new moments are on the device at once
                    written[i - 2].synchronize()
            for (p, k), (dev, _) in staged[i].items():
                self.state[p][k] = dev
            self._update(group, chunk)
            if copy_out is not None:
                copy_out.wait_stream(compute)
            with _on(copy_out):
                fresh = [
                    (p, k) for p in chunk for k in self._moments(p, self.state[p]) if (p, k) not in staged[i]
                ]
                arena, off = _host_arena(sum(_aligned(self.state[p][k].nbytes) for p, k in fresh), device), 0
                # torch's new moments (a parameter's first step): into host memory of their own
                for p, k in fresh:
                    dev = self.state[p][k]
                    staged[i][(p, k)] = (dev, _carve(arena, off, dev))
                    off += _aligned(dev.nbytes)
                    if copy_out is not None:
                        dev.record_stream(copy_out)  # freed once copied
                for (p, k), (dev, host) in staged[i].items():
                    host.copy_(dev, non_blocking=True)
                    self.state[p][k] = host
                if copy_out is not None:
                    written[i] = torch.cuda.Event()
                    written[i].record(copy_out)
            staged[i] = {}
        self._copies_done = written[-1]
        return loss

    def _update(self, group: dict, chunk: list[torch.Tensor]) -> None:
        """torch's AdamW step over ``chunk`` (a group of ``group``'s settings holding only these parameters)."""
        groups, self.param_groups = self.param_groups, [{**group, "params": chunk}]
        try:
            _ADAM_STEP(self)
        finally:
            self.param_groups = groups

    # -- checkpoints: torch's state_dict, read once the copies are done; a loaded state goes to the host

    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)  # torch casts each moment to its parameter's device and dtype
        for p, state in self.state.items():
            for k in self._moments(p, state):
                if state[k].device.type != "cpu":
                    host = _carve(_host_arena(state[k].nbytes, state[k].device), 0, state[k])
                    host.copy_(state[k])
                    state[k] = host


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _carve(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype, shape and strides over ``buf``'s bytes from ``offset`` (``like`` is dense)."""
    n = like.numel() * like.element_size()
    return buf[offset : offset + n].view(like.dtype).as_strided(like.shape, like.stride())


def _host_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host bytes for one chunk's new moments: pinned when they come from CUDA. One block a chunk, not one a
    moment: the pinned allocator rounds each block up to a power of two."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
