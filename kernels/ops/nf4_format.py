"""The NF4 format's facts that need no kernel: bitsandbytes' code table and the digest both services compare.

Plain torch, no Triton: the export service (CPU nodes, no Triton installed) imports this module to check that its
re-creation of an NF4 base is bit-identical to the codes the trainer trained on (``nf4.py`` holds the format's
description and the dequantization kernel).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["NF4_CODE", "nf4_digest"]

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4")), the same fp32 constants its CUDA kernel uses; fmt: skip
# keeps it four codes a row (negative, negative to zero, positive, positive to one).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def nf4_digest(packed: torch.Tensor, quant_state) -> str:
    """sha256 of one NF4 weight's 4-bit codes and their absmax (nested: the absmax's codes, then the absmax's
    absmax and offset), as bytes whatever the codes' storage dtype (``bnb_4bit_quant_storage``).

    Args:
        packed: The ``Params4bit`` data (the packed codes).
        quant_state: Its bitsandbytes ``QuantState``.
    """
    h = hashlib.sha256()
    qs = quant_state
    parts = [packed, qs.absmax] + ([qs.state2.absmax, qs.offset] if qs.nested else [])
    for t in parts:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
