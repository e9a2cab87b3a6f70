"""Counting the loss reads of HF's training loop: HF's ``logging_nan_inf_filter`` reads each step's loss back
(``torch.Tensor.__bool__`` inside ``transformers/trainer.py``'s loop) while the optimizer's Python waits on it;
strop's trainers filter on the device instead, and the tests show the difference with this counter."""

from __future__ import annotations

import sys

import torch

_LOOP_FUNCTIONS = ("_run_epoch", "_inner_training_loop")


class LoopBoolReads:
    """Patches ``torch.Tensor.__bool__`` (through ``monkeypatch``) to count, under the label in :attr:`current`,
    every call made directly from HF's training loop; :attr:`counts` maps label → reads."""

    def __init__(self, monkeypatch) -> None:
        self.current: str | None = None
        self.counts: dict[str | None, int] = {}
        original = torch.Tensor.__bool__

        def counting_bool(tensor):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith("transformers/trainer.py") and caller.co_name in _LOOP_FUNCTIONS:
                self.counts[self.current] = self.counts.get(self.current, 0) + 1
            return original(tensor)

        monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
