"""The README's library example (load, patch, hand to TRL) runs on the kernels and learns."""

from __future__ import annotations

from strop.demo.library_example import main


def test_patched_model_trains_under_trls_sft_trainer():
    losses = main(["--steps", "2"])  # the fewest steps in which a loss can fall
    assert len(losses) == 2
    assert losses[-1] < losses[0], "one SFT update at lr 2e-3 on the fixed rows lowers the next step's loss"
