"""Evaluating a job's validation set inside its TRL trainer, with the method's own loss, without touching training.

The validation rows are shaped like the training rows (``sft_rows``, ``preference_rows``) and handed to the TRL
trainer as its ``eval_dataset``, so TRL tokenizes, truncates and masks them by the job's own rules (SFT: unpacked);
the periodic sample is the first ``eval_rows`` of the prepared rows. ``EvalSchedule`` asks HF's loop for an evaluation every
``eval_every_steps`` steps and at the last step; HF runs it after the step is logged and before the step's
checkpoint is saved, so a checkpoint carries the evaluation of its step. ``Validating.evaluate`` (HF's public hook)
runs :class:`Evaluator` instead of HF's prediction loop, whose loss is a mean of per-batch means (not SFT's
token mean) and whose ``prediction_step`` asks the preference trainers for logits.

Each batch's loss is the trainer's own code: SFT ``compute_loss`` (the fused LM head: per-token log-probs in
chunks; strop's kernel when the kernels are on), DPO and KTO ``compute_loss`` (against the job's reference),
ORPO and SimPO ``get_batch_loss_metrics(train_eval="eval")`` (their ``compute_loss`` files its metrics as
training's). With the kernels on the preference methods run strop's chunked losses: full logits never exist.
The model is in eval mode under ``torch.no_grad`` and back in its mode after; nothing random is drawn, no
gradient or optimizer state is touched, so training's losses are those of a job without validation, bit for bit
(tests/trainer_svc/test_validation.py).

What a loss is (trainer.proto's ``EvalMetrics``): SFT, the token-mean NLL over every token the job's masking
trains on, over the whole pass (sum of NLL / tokens, not a mean of batch means), and the share of those tokens
whose argmax is the label; DPO, ORPO, KTO and SimPO, each batch's loss weighted by its rows (the row mean for
DPO and SimPO; ORPO's NLL term and KTO's KL estimate are per batch, as in training).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import DpoMetrics, EvalMetrics, TrainConfig, TrainMethod

log = logging.getLogger("strop.trainer")

SAMPLE, FULL = "sample", "full"


@dataclass
class ValidationSet:
    """A job's held-out rows (validated like its training rows) and the dataset they came from."""

    dataset_id: str
    rows: list[dict]


def eval_dataset(rows: list[dict]):
    """The TRL trainer's ``eval_dataset`` (``rows`` shaped as the method's trainer reads them); TRL prepares it as it
    prepares the training rows. One dataset: ORPO's and CPO's trainers take no dict of them."""
    from datasets import Dataset

    return Dataset.from_list(rows)


@dataclass
class _Pass:
    """Sums over one pass of an eval dataset."""

    loss_sum: float = 0.0  # SFT: NLL summed over tokens; others: each batch's loss × its rows
    weight: int = 0  # SFT: the loss's tokens; others: rows
    correct: int = 0  # SFT: tokens whose argmax is the label
    rows: int = 0
    tokens: int = 0
    # TRL's metric key -> [sum of value × rows, rows] (KTO logs its chosen/rejected metrics on batches that have such rows)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight if self.weight else float("nan")


def _sft_batch(trainer, model, inputs: dict, p: _Pass, rows: int) -> None:
    # the tokens the fused head scores, by its rule: position t scores labels[t + 1] (or shift_labels[t])
    scored = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
    n = int((scored != -100).sum())
    # num_items_in_batch=1: TRL's loss is then the NLL summed over the batch's loss tokens (it divides by it);
    # return_outputs stays False (TRL would recompute the full logits for it)
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=1)
    metrics = _eval_metrics(trainer)
    accuracy = metrics["mean_token_accuracy"][-1]  # TRL's: this batch's hits / n
    p.loss_sum += float(loss)
    p.weight += n
    p.tokens += n
    p.correct += round(accuracy * n)
    metrics.clear()  # read batch by batch


def _eval_metrics(trainer) -> dict:
    """The eval-mode metrics TRL's ``compute_loss`` appends to (logged by HF's prediction loop, which is not run)."""
    return getattr(trainer, "_metrics", {}).get("eval", {})


def _loss_metrics_batch(trainer, model, inputs: dict, p: _Pass, rows: int) -> None:
    """DPO, KTO: ``compute_loss`` in eval mode (its metrics go to TRL's eval metrics, read and cleared here)."""
    loss = trainer.compute_loss(model, inputs)
    metrics = _eval_metrics(trainer)
    _add(p, float(loss), rows, {k: v[-1] for k, v in metrics.items() if v}, inputs)
    metrics.clear()  # read batch by batch: a metric's last value is this batch's


def _batch_loss_metrics_batch(trainer, model, inputs: dict, p: _Pass, rows: int) -> None:
    """ORPO, SimPO: ``get_batch_loss_metrics(train_eval="eval")``; their ``compute_loss`` stores metrics as train."""
    import torch

    autocast = (
        torch.autocast(trainer.accelerator.device.type)
        if getattr(trainer, "_peft_has_been_casted_to_bf16", False)
        else contextlib.nullcontext()
    )  # what their compute_loss wraps the call in
    with autocast:
        loss, metrics = trainer.get_batch_loss_metrics(model, inputs, train_eval="eval")
    _add(p, float(loss), rows, {k.removeprefix("eval_"): float(v) for k, v in metrics.items()}, inputs)


def _add(p: _Pass, loss: float, rows: int, metrics: Mapping[str, float], inputs: dict) -> None:
    p.loss_sum += loss * rows
    p.weight += rows
    p.tokens += sum(int(v.sum()) for k, v in inputs.items() if k.endswith("attention_mask"))
    for k, v in metrics.items():
        acc = p.metrics.setdefault(k, [0.0, 0])
        acc[0] += float(v) * rows
        acc[1] += rows


# one table: each method's eval batch
BATCH_LOSS: dict[TrainMethod, Callable] = {
    TrainMethod.SFT: _sft_batch,
    TrainMethod.DPO: _loss_metrics_batch,
    TrainMethod.KTO: _loss_metrics_batch,
    TrainMethod.ORPO: _batch_loss_metrics_batch,
    TrainMethod.SIMPO: _batch_loss_metrics_batch,
}


class Evaluator:
    """Runs a job's evaluations on its trainer and reports each (``on_eval``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        on_eval: Callable[[EvalMetrics], None],
        preference_keys: Mapping[str, str],
    ) -> None:
        self.cfg, self.on_eval, self.preference_keys = cfg, on_eval, preference_keys

    def attach(self, trainer) -> None:
        """Once TRL prepared the eval dataset: the sets to evaluate, ``full`` and (``eval_rows`` fewer than its rows)
        ``sample``, its first ``eval_rows`` rows. An empty set cannot be evaluated (the job's input is wrong)."""
        full = trainer.eval_dataset
        if len(full) == 0:
            raise InvalidArgument(
                "validation_dataset_id: no validation row is left to evaluate once prepared like the training rows"
            )
        self.sets = {FULL: full}
        if 0 < self.cfg.eval_rows < len(full):
            self.sets[SAMPLE] = full.select(range(self.cfg.eval_rows))
        trainer.strop_evaluator = self

    def run(self, trainer, *, final: bool) -> EvalMetrics:
        """One evaluation at the trainer's step: the sample (or the whole set), and at the last step the whole set."""
        sets = self.sets
        sample = self._pass(trainer, SAMPLE if SAMPLE in sets else FULL)
        full = sample if SAMPLE not in sets else (self._pass(trainer, FULL) if final else None)
        sft = self.cfg.method is TrainMethod.SFT
        shown = full or sample
        m = EvalMetrics(
            step=int(trainer.state.global_step),
            valid_loss=sample.loss,
            full_valid_loss=full.loss if full else 0.0,
            valid_mean_token_accuracy=sample.correct / max(sample.weight, 1) if sft else None,
            rows=shown.rows,
            tokens=shown.tokens,
            is_full=full is not None,
            full_valid_mean_token_accuracy=full.correct / max(full.weight, 1) if sft and full else None,
            dpo=None if sft else self._dpo(sample),
        )
        self.on_eval(m)
        return m

    def _dpo(self, p: _Pass) -> DpoMetrics:
        mean = {k: total / rows for k, (total, rows) in p.metrics.items()}
        return DpoMetrics(**{f: float(mean.get(key, 0.0)) for f, key in self.preference_keys.items()})

    def _pass(self, trainer, name: str) -> _Pass:
        import torch

        batch_loss = BATCH_LOSS[self.cfg.method]
        model = trainer.model
        data = self.sets[name]
        n, size = len(data), self.cfg.eval_batch_size
        p = _Pass()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                # a SequentialSampler without drop_last: batch i holds rows [i·size, min((i+1)·size, n))
                for i, batch in enumerate(trainer.get_eval_dataloader(data)):
                    rows = min(size, n - i * size)
                    inputs = trainer._prepare_inputs(batch)
                    with trainer.compute_loss_context_manager():
                        batch_loss(trainer, model, inputs, p, rows)
                    p.rows += rows
        finally:
            model.train(was_training)
        return p


class Validating:
    """Mixed into a job's TRL trainer class (``training.build_trainer``): HF's ``evaluate`` hook runs the job's
    :class:`Evaluator` (set as ``strop_evaluator``) and answers ``eval_loss`` = the valid_loss."""

    strop_evaluator: Evaluator

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        final = self.state.global_step >= self.state.max_steps
        m = self.strop_evaluator.run(self, final=final)
        metrics = {f"{metric_key_prefix}_loss": m.valid_loss}
        # as HF's evaluate ends: the callbacks see it, and should_evaluate is cleared (HF's loop would otherwise
        # evaluate the same step again at the epoch's end)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def eval_schedule(every: int):
    """The callback asking HF's loop for an evaluation every ``every`` steps (> 0) and at the last step (a job
    stopped early by cancel or drain evaluates only on schedule)."""
    from transformers import TrainerCallback

    class EvalSchedule(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if (every > 0 and state.global_step % every == 0) or state.global_step >= state.max_steps:
                control.should_evaluate = True
            return control

    return EvalSchedule()
