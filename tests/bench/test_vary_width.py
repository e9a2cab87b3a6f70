"""The training bench's batches of varying width (``--vary-width``, bench/lib/harness.py ``varied_lengths``,
bench/lib/train_workers.py ``varied_batches``): the same seeded widths for every system, padding that no loss or
token count reads, and speeds over the real tokens of the measured steps."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from lib.harness import Result, varied_lengths, workload  # noqa: E402
from lib.train_workers import varied_batches  # noqa: E402


def test_each_step_has_its_drawn_width_and_rows_within_it():
    steps = varied_lengths(2048, 512, batch=8, steps=40)
    assert steps == varied_lengths(2048, 512, batch=8, steps=40), (
        "seeded: every system trains the same sequence"
    )
    for lengths in steps:
        width = lengths[0]
        assert len(lengths) == 8 and 1536 <= width <= 2048, "the step's width in [seq - N, seq]"
        assert max(lengths) == width and min(lengths) >= 1536, "its first row the longest, the others within"
    widths = [s[0] for s in steps]
    assert len(set(widths)) > 30, "a new width nearly every step, as early in a chat SFT job"


def test_library_batches_pad_as_trls_collator_does():
    a = SimpleNamespace(seq=64, vary_width=32, batch=3, warmup=1, steps=2)
    batches = varied_batches(a, workload("qlora", smoke=True), vocab=640)
    for batch, lengths in zip(batches, varied_lengths(64, 32, 3, 3), strict=True):
        assert batch["input_ids"].shape == (3, max(lengths))
        assert batch["attention_mask"].sum(1).tolist() == lengths, "the real tokens, then mask 0"
        real = batch["attention_mask"] == 1
        assert (batch["labels"][~real] == -100).all() and (batch["input_ids"][~real] == 0).all()
        assert torch.equal(batch["labels"][real], batch["input_ids"][real]), "every real token scored"


def test_varied_speed_counts_real_tokens_over_the_measured_steps():
    w = workload("qlora", smoke=True)
    res = Result("qlora", "baseline", 64, 2)
    w.record_varied_speed(res, [3.0, 0.5, 1.5], warmup=1, real_tokens=[100, 90, 70], recompute=1.0)
    assert res.step_ms == [3000.0, 500.0, 1500.0], "every step, the warm-up's included"
    assert res.ms_per_step == pytest.approx(1000.0), "the measured steps' mean"
    assert res.tokens_per_s == pytest.approx((90 + 70) / 2.0), "real tokens over the measured time"
