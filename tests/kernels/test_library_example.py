"""The README's library example (load, patch, hand to TRL) runs on the kernels and learns."""

from __future__ import annotations

from strop.demo.library_example import main


def test_patched_model_trains_under_trls_sft_trainer():
    losses = main(["--steps", "3"])
    assert len(losses) == 3
    assert losses[-1] < losses[0], "three SFT steps at lr 2e-3 on the fixed rows lower the loss"
