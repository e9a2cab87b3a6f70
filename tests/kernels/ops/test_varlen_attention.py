"""Packed attention's backward sum (``kernels/ops/varlen_attention.py``): each key row's gradient is the sum of its
readings, added in fp32 and rounded once to the compute dtype, whatever order the readings come in.

The attention itself (packed against the dense-mask attention, outputs and gradients) is tested where the shared
prompt's rows use it, ``tests/kernels/trainers/test_shared_prompt.py``; the flash kernels on CUDA there too.
"""

from __future__ import annotations

import torch

from strop.kernels.ops import varlen_attention as va


def test_a_key_read_by_several_sequences_gets_their_gradients_summed_in_fp32_and_rounded_once():
    """Row 0 is read by three sequences, row 1 by two, rows 2–4 once: the bf16 result is the fp32 sum of each row's
    readings rounded once (bitwise); summing in bf16 reading by reading gives another value for these readings
    (1 + 2^-9 + 2^-9 rounds up in fp32-then-bf16, stays at 1 in bf16 steps), so the test can tell."""
    packing = va.Packing.build([(0, 2, [(0, 2)]), (2, 1, [(0, 2), (2, 1)]), (3, 2, [(0, 1), (3, 2)])], "cpu")
    assert packing.k_index.tolist() == [0, 1, 0, 1, 2, 0, 3, 4]
    eps = 3 * 2.0**-10
    readings = torch.tensor([1.0, 1.0, eps, eps, 3.0, eps, 4.0, 5.0])[:, None, None].bfloat16()
    got = va._sum_readings(readings, packing)
    want = torch.zeros(5, 1, 1).index_add_(0, packing.k_index, readings.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got[0].item() == 1 + 2.0**-7 and (readings[0] + readings[2] + readings[5]).item() == 1.0
    # one reading each: the gather alone, no rounding
    single = va.Packing.build([(0, 3, [(0, 3)])], "cpu")
    assert single.extra == () and torch.equal(va._sum_readings(readings[:3], single), readings[:3])
