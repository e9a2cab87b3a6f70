"""Replay of a forward's RNG and autocast state for a recompute (offloaded checkpointing, the tiled MLP),
and plain checkpointing as the reference both are tested against."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# ---- replay of the forward's RNG and autocast state (shared by offload and tiled_mlp) ---------------------------


@dataclass
class ReplayState:
    """What a recompute needs so it computes exactly what the forward did: RNG and autocast state."""

    device: torch.device
    cpu_rng: torch.Tensor | None
    cuda_rng: torch.Tensor | None
    autocast: tuple[tuple[str, bool, torch.dtype, bool], ...]

    @classmethod
    def capture(cls, device: torch.device, preserve_rng: bool = True) -> ReplayState:
        """Snapshot the current RNG (CPU and ``device``'s CUDA generator) and autocast state."""
        types = ("cpu",) if device.type == "cpu" else (device.type, "cpu")
        autocast = tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
            for t in types
        )
        cpu_rng = torch.get_rng_state() if preserve_rng else None
        cuda_rng = torch.cuda.get_rng_state(device) if preserve_rng and device.type == "cuda" else None
        return cls(device, cpu_rng, cuda_rng, autocast)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under the captured state; the caller's RNG state is restored afterwards."""
        cuda = self.device.type == "cuda"
        devices = (
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            if cuda
            else []
        )
        with contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda"))
                torch.set_rng_state(self.cpu_rng)
                if self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, self.device)
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(
                    torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
                )
            yield


# ---- reference -------------------------------------------------------------------------------------------


def checkpoint_reference(function: Callable[..., Any], *args: Any) -> Any:
    """What offloaded checkpointing must compute: torch's own non-reentrant checkpoint of ``function(*args)``."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
