"""The gradient guard: a job whose training is broken fails at once, naming the tensors and why; never SUCCEEDED.

Checked at every optimizer step: each trainable tensor has a gradient, every gradient is finite, the loss is
finite, every adapter is finite after the update; within the first ``GUARD_WINDOW_STEPS`` steps every
trainable tensor must also see a non-zero gradient at least once.
"""

from __future__ import annotations

import math


class BrokenTraining(RuntimeError):
    """A step left an adapter tensor without a usable gradient, or made the loss or the adapters non-finite.

    ``code``: INVALID_ARGUMENT where the job's input is the cause (non-finite loss, gradients or adapters: the
    learning rate, weight decay or data), INTERNAL where the service is (a tensor the graph does not reach).
    """

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self.code = code


GUARD_WINDOW_STEPS = 3  # optimizer steps within which every adapter tensor must see a non-zero gradient


def names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} (and {len(names) - limit} more)" if len(names) > limit else shown


def make_guard(model):
    """A callback that fails the job the moment training is broken, naming the tensors and why.

    Checked at every optimizer step: each trainable tensor has a gradient, every gradient is finite, the
    loss is finite, every adapter is finite after the update. Within the first ``GUARD_WINDOW_STEPS``
    steps every trainable tensor must also see a non-zero gradient at least once. A LoRA ``A`` whose ``B``
    is exactly zero has an exactly zero gradient by construction (dA = s·xᵀ(g·B)); such steps are
    excused, so a fresh adapter (B = 0) or a first warm-up step at lr 0 is not mistaken for a cut graph.

    The per-tensor max |·| of the gradients (and, within the window, of each ``A``'s ``B``) is taken on the device
    before the optimizer step and of the adapters after it (fused ``_foreach_norm(inf)``s), and all are read in one
    host sync after the step, then checked in that order. A read before the step would leave the GPU idle while
    the host runs the optimizer's Python. Non-finite gradients make the update non-finite too; the job fails at
    the same step with the same message either way, and a failed job's session gets back the adapter it had
    before the job (``jobs``).
    """
    import torch
    from transformers import TrainerCallback

    def max_abs(tensors) -> torch.Tensor:
        """Each tensor's max |·|, fp32, on the device (not read)."""
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(t, DTensor) for t in tensors)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        norms = torch.stack(torch._foreach_norm(local, float("inf"))).float()
        if sharded:
            # FSDP2: each rank holds a shard (maybe empty) of each tensor; the max over the ranks is the tensor's,
            # the same on every rank, so they all raise together. NaN becomes inf first: NCCL's MAX drops NaNs.
            norms = torch.nan_to_num(norms, nan=math.inf)
            torch.distributed.all_reduce(norms, op=torch.distributed.ReduceOp.MAX)
        return norms

    class GradientGuard(TrainerCallback):
        def __init__(self) -> None:
            self.params: list[tuple[str, torch.nn.Parameter]] = []
            self.steps = 0
            self.never_nonzero: set[str] = set()
            self.unexcused_zero: set[str] = set()
            self.partner: dict[str, torch.Tensor] = {}  # each lora_A's name -> its lora_B
            self.before: list[torch.Tensor] = []  # on the device: max |grad| (and the window's max |B|)

        def on_train_begin(self, args, state, control, **kw):
            self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self.never_nonzero = {n for n, _ in self.params}
            by_name = dict(self.params)
            self.partner = {n: by_name[n.replace("lora_A", "lora_B")] for n in by_name if "lora_A" in n}

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.steps += 1
            step = state.global_step + 1
            missing = [n for n, p in self.params if p.grad is None]
            if missing:
                raise BrokenTraining(
                    f"step {step}: {len(missing)} of {len(self.params)} trainable tensors got no gradient "
                    f"(the graph from the loss does not reach them): {names(missing)}"
                )
            before = [max_abs([p.grad for _, p in self.params])]
            if self.steps <= GUARD_WINDOW_STEPS and self.partner:
                before.append(
                    max_abs([self.partner[n].detach() for n in self.partner])
                )  # each B before the step
            self.before = before  # read after the step, with the adapters

        def on_optimizer_step(self, args, state, control, **kw):
            step = state.global_step + 1
            n = len(self.params)
            values = torch.cat([*self.before, max_abs([p.detach() for _, p in self.params])]).cpu().tolist()
            grads, after = values[:n], values[-n:]
            partner_max = dict(zip(self.partner, values[n:-n], strict=True)) if len(values) > 2 * n else {}
            self.before = []
            bad = [name for (name, _), g in zip(self.params, grads, strict=True) if not math.isfinite(g)]
            if bad:
                raise BrokenTraining(
                    f"step {step}: non-finite gradients in {len(bad)} of {n} trainable tensors: "
                    f"{names(bad)} (lower the learning rate, or check the data and max_grad_norm)",
                    code="INVALID_ARGUMENT",
                )
            if self.steps <= GUARD_WINDOW_STEPS:
                zero = [name for (name, _), g in zip(self.params, grads, strict=True) if g == 0.0]
                self.never_nonzero &= set(zero)
                for name in zero:  # a zero dA is excused while its B is exactly zero (the same on every rank)
                    if partner_max.get(name, 1.0) != 0.0:
                        self.unexcused_zero.add(name)
                if self.steps == GUARD_WINDOW_STEPS:
                    self._check_window(step)
            bad = [name for (name, _), v in zip(self.params, after, strict=True) if not math.isfinite(v)]
            if bad:
                raise BrokenTraining(
                    f"step {step}: the optimizer step made {len(bad)} adapter tensors "
                    f"non-finite: {names(bad)} (the learning rate or weight decay is too large)",
                    code="INVALID_ARGUMENT",
                )

        def on_log(self, args, state, control, logs=None, **kw):
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                raise BrokenTraining(f"step {state.global_step}: the loss is {loss}", code="INVALID_ARGUMENT")

        def on_train_end(self, args, state, control, **kw):
            if 0 < self.steps < GUARD_WINDOW_STEPS:
                self._check_window(state.global_step)

        def _check_window(self, step: int) -> None:
            dead = sorted(self.never_nonzero & self.unexcused_zero)
            if dead:
                raise BrokenTraining(
                    f"by step {step}: {len(dead)} of {len(self.params)} trainable tensors got only zero "
                    f"gradients (no signal reaches them): {names(dead)}"
                )

    return GradientGuard()
