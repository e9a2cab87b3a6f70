"""A session's adapter as values: checked finite before it is published, snapshotted before a job and restored
when the job fails, so a FAILED job leaves the session as it found it.

A failed job's weights are what broke it: a learning rate of 1e308 turns every adapter value into inf or NaN
in one optimizer step, and a session keeping them would publish them (SaveAdapter, exports), answer Generate
with nothing and fail every later job. The snapshot is the PEFT state dict (what ``save_pretrained`` writes: the
LoRA matrices, a few hundred MB in fp32 for an 8B model at r=16) in host memory; restoring copies it back into
the same parameters, which the fused kernels keep reading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strop.common.errors import FailedPrecondition

if TYPE_CHECKING:
    import torch

    from strop.trainer_svc.core.model_loading import LoadedModel

Snapshot = dict[str, "torch.Tensor"]


def snapshot(loaded: LoadedModel) -> Snapshot:
    """A host copy of the session's adapter values."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(loaded.model).items()}


def restore(loaded: LoadedModel, snap: Snapshot) -> None:
    """Copy ``snap`` back into the session's adapter parameters (in place: the same tensors)."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(loaded.model, snap)


def check_finite(loaded: LoadedModel, what: str) -> None:
    """Refuse to publish an adapter holding inf or NaN.

    Raises:
        FailedPrecondition: naming how many values are not finite and the first tensor holding one.
    """
    import torch
    from peft import get_peft_model_state_dict

    bad, total, first = 0, 0, ""
    with torch.no_grad():
        for name, t in get_peft_model_state_dict(loaded.model).items():
            n = int((~torch.isfinite(t)).sum())
            total += t.numel()
            if n and not first:
                first = name
            bad += n
    if bad:
        raise FailedPrecondition(
            f"{what}: the adapter holds {bad} non-finite values of {total} (first in {first}); it is not published"
        )
