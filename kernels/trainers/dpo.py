"""TRL glue: ``DPOTrainer`` on the backbone's hidden states and strop's chunked DPO loss.

``StropDPOMixin`` replaces TRL's ``compute_loss`` with :func:`strop.kernels.losses.strop_dpo_loss`'s pieces
(``sequence_logps`` on the final hidden states, then the DPO formulas), so full logits never exist;
``add_hidden_states_head`` is the model surgery it needs (a reversible forward swap that returns the
backbone output). Everything else — collation, reference handling, optimisation, logging — is TRL's.
This is the room that reads ``DPOTrainer`` internals; the loss itself knows nothing of TRL.
"""

from __future__ import annotations

from typing import Any

import torch

from ..losses.dpo import LOSS_TYPES, dpo_loss_on_pairs
from ..losses.logps import sequence_logps
from ._glue import (
    DeviceMetrics,
    DeviceNanFilter,
    add_hidden_states_head,
    final_logit_softcap,
    head_unsupported_reason,
    hf_model,
    reference_adapter,
    reference_pass,
    remove_hidden_states_head,
    start_chunked_loss,
    trl_reference_helpers,
    unwrapped_model,
    width_buckets,
)
from .shared_prompt import PromptSharing, bucketed_width

__all__ = ["StropDPOMixin", "add_hidden_states_head", "remove_hidden_states_head", "strop_dpo_trainer_class"]

# ---- trainer glue: TRL's DPOTrainer on the backbone's hidden states + this loss ---------------------------


def _dpo_trl_helpers() -> tuple[Any, Any]:
    from trl.trainer.dpo_trainer import disable_gradient_checkpointing, use_adapter

    return disable_gradient_checkpointing, use_adapter


class StropDPOMixin(DeviceMetrics, DeviceNanFilter):
    """Mix into TRL's ``DPOTrainer`` so its loss is :func:`strop_dpo_loss` on the backbone's hidden states::

        from trl import DPOTrainer
        from strop.kernels.trainers import StropDPOMixin

        class StropDPOTrainer(StropDPOMixin, DPOTrainer):
            pass

    (or ``strop_dpo_trainer_class()``). Everything else is TRL's: data collation, reference handling (the
    PEFT model with adapters disabled, a "ref" adapter, a separate ``ref_model`` or precomputed
    ``ref_chosen_logps``/``ref_rejected_logps``), optimisation, logging. The loss replaces TRL's
    ``_compute_loss`` and logs the same rewards/* and logps/* metrics (and num_tokens); TRL's
    entropy, logits/* and mean_token_accuracy need a second pass over the vocabulary and are not logged.

    Configurations the chunked loss does not cover run TRL's own ``compute_loss``, with the reason logged
    once: loss types other than sigmoid/hinge/ipo/robust, ``f_divergence_type`` other than reverse_kl,
    ``ld_alpha``, ``use_weighting``, MoE aux loss, a trainable or scaled LM head, prompt learning, and
    ``return_outputs=True`` (evaluation with logits). A final-logit soft-cap (Gemma's
    ``final_logit_softcapping``) is applied inside the chunked loss, as HF's forward applies it to the logits.

    Pairs run unshared (TRL's rows) reach the model with their width rounded up to a bucket where
    ``shared_prompt.WIDTH_BUCKETS`` says so (``sft.py``'s docstring says why): padding columns, attention and
    completion masks 0, so the same log-probs and gradients.
    """

    # Run each pair's prompt once, chosen and rejected completions after it (``shared_prompt.py``); exact up to
    # rounding. Set False on the class or instance to run TRL's [chosen; rejected] rows as they are.
    strop_share_prompts: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strop_dpo_reason = self._strop_unsupported_reason()
        self._strop_sharing = PromptSharing("DPO")
        # pairs run unshared reach the model in bucketed widths (shared_prompt.WIDTH_BUCKETS), unless the user's
        # collator chose the widths (pad_to_multiple_of) or has no pad token id to pad with
        collator = self.data_collator
        self._strop_pad_id = getattr(collator, "pad_token_id", None)
        self._strop_width_buckets = (
            width_buckets(self)
            and self._strop_pad_id is not None
            and getattr(collator, "pad_to_multiple_of", None) is None
        )
        start_chunked_loss(self, "DPO", self._strop_dpo_reason)

    # -- helpers

    def _strop_hf_model(self, model: Any) -> Any:
        return hf_model(self.accelerator, model)

    def _strop_softcap(self, model: Any) -> float | None:
        """The model's final-logit soft-cap (HF: ``logits = c · tanh(logits / c)``), or None."""
        return final_logit_softcap(self._strop_hf_model(model))

    def _strop_unsupported_reason(self) -> str | None:
        bad = [t for t in getattr(self, "loss_types", ["?"]) if t not in LOSS_TYPES]
        if bad:
            return f"loss_type {bad} (chunked DPO has {list(LOSS_TYPES)})"
        if str(getattr(self, "f_divergence_type", "reverse_kl")).split(".")[-1].lower() != "reverse_kl":
            return f"f_divergence_type={self.f_divergence_type}"
        if getattr(self, "ld_alpha", None) is not None:
            return "ld_alpha (LD-DPO length weighting)"
        if getattr(self, "use_weighting", False):
            return "use_weighting (WPO)"
        if getattr(self, "aux_loss_enabled", False):
            return "MoE router aux loss"
        return head_unsupported_reason(self.accelerator, self.model, "chunked DPO scores")

    @property
    def strop_shared_batches(self) -> int:
        """Batches whose pairs ran their prompt once."""
        return self._strop_sharing.batches

    def _strop_reference_hidden(self, model_kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, float | None]:
        disable_gc, use_adapter = trl_reference_helpers(_dpo_trl_helpers)
        with torch.no_grad(), reference_pass(self.model, disable_gc, self.args.gradient_checkpointing_kwargs):
            if self.ref_model is None:
                unwrapped = unwrapped_model(self.accelerator, self.model)
                peft_cfg = getattr(unwrapped, "peft_config", None)
                if peft_cfg is None:
                    raise ValueError(
                        "chunked DPO needs a ref_model, a PEFT model, or precomputed reference log-probs"
                    )
                with reference_adapter(unwrapped, peft_cfg, use_adapter):
                    out = self.model(**model_kwargs, strop_hidden_states=True)
                head_model = self.model
            else:
                out = self.ref_model(**model_kwargs, strop_hidden_states=True)
                head_model = self.ref_model
        return (
            out.last_hidden_state,
            self._strop_hf_model(head_model).get_output_embeddings(),
            self._strop_softcap(head_model),
        )

    # -- the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._strop_dpo_reason or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        non_model = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
        model_kwargs = {k: v for k, v in inputs.items() if k not in non_model}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)

        plain_kwargs = model_kwargs
        shared = None
        if self.strop_share_prompts:
            shared = self._strop_sharing.layout(
                self._strop_hf_model(self.model), model_kwargs, completion_mask
            )
        if shared is not None:
            model_kwargs = {**shared.model_kwargs(), "use_cache": False}
        elif self._strop_width_buckets:  # TRL's rows, their width rounded up to a bucket (labels -100 there)
            rows = {k: v for k, v in model_kwargs.items() if k != "use_cache"}
            cap = getattr(self.args, "max_length", None)
            rows = dict(bucketed_width({**rows, "completion_mask": completion_mask}, self._strop_pad_id, cap))
            labels = rows["input_ids"].masked_fill(rows.pop("completion_mask") == 0, -100)
            model_kwargs = plain_kwargs = {**rows, "use_cache": False}
        unshare = (lambda h: h) if shared is None else shared.unshare
        # the shared layout read the batch into host memory once: the scored rows are found there
        host_labels = None
        if shared is not None:
            ids_host, completion_host = shared.host
            host_labels = ids_host.masked_fill(completion_host == 0, -100)
        hidden = unshare(model(**model_kwargs, strop_hidden_states=True).last_hidden_state)
        head = self._strop_hf_model(self.model).get_output_embeddings()
        hidden = hidden.to(head.weight.device)
        labels = labels.to(head.weight.device)
        logps = sequence_logps(
            hidden,
            head.weight,
            labels,
            head.bias,
            softcap=self._strop_softcap(self.model),
            host_labels=host_labels,
        )
        if getattr(self, "precompute_ref_logps", False) or "ref_chosen_logps" in inputs:
            ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).float()
        else:
            # a separate ref_model runs TRL's rows: the layout was made for the policy's attention and device
            own = self.ref_model is None
            ref_hidden, ref_head, ref_softcap = self._strop_reference_hidden(
                model_kwargs if own else plain_kwargs
            )
            with torch.no_grad():
                ref = sequence_logps(
                    (unshare(ref_hidden) if own else ref_hidden).to(ref_head.weight.device),
                    ref_head.weight,
                    labels,
                    ref_head.bias,
                    softcap=ref_softcap,
                    host_labels=host_labels,
                )
        out = dpo_loss_on_pairs(
            logps,
            ref.to(logps.device),
            labels,
            -100,
            self.beta,
            self.loss_types,
            getattr(self, "loss_weights", None),
            self.label_smoothing,
        )

        # TRL's metrics as device tensors, read at the next log (DeviceMetrics): no read between forward and backward
        gather = self.accelerator.gather
        metrics = self._metrics[mode]
        if mode == "train":
            self._strop_hold_tokens(self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum())
        else:
            self._strop_fold_tokens()  # TRL's eval num_tokens is the train count as the evaluation runs
        metrics["num_tokens"] = [getattr(self, "_total_train_tokens", 0)]
        c, r = out.chosen_rewards, out.rejected_rewards  # detached by the loss
        metrics["rewards/chosen"].append(gather(c).mean())
        metrics["rewards/rejected"].append(gather(r).mean())
        metrics["rewards/accuracies"].append(gather((c > r).float()).mean())
        metrics["rewards/margins"].append(gather(c - r).mean())
        metrics["logps/chosen"].append(gather(out.chosen_logps.detach()).mean())
        metrics["logps/rejected"].append(gather(out.rejected_logps.detach()).mean())
        return out.loss


_TRAINER_CLASS: Any = None


def strop_dpo_trainer_class() -> type:
    """``class StropDPOTrainer(StropDPOMixin, trl.DPOTrainer)``, built on first use (TRL is imported then)."""
    global _TRAINER_CLASS
    if _TRAINER_CLASS is None:
        from trl import DPOTrainer

        _TRAINER_CLASS = type("StropDPOTrainer", (StropDPOMixin, DPOTrainer), {"__module__": __name__})
    return _TRAINER_CLASS
