"""TRL glue: ``ORPOTrainer``, ``CPOTrainer`` (SimPO) and ``KTOTrainer`` on the backbone's hidden states and strop's
chunked preference losses (:mod:`strop.kernels.losses.orpo`, ``cpo``, ``kto``).

Each mixin overrides the narrowest method its TRL trainer routes the loss through: ORPO's and CPO's
``get_batch_loss_metrics`` (``compute_loss`` and ``prediction_step`` both call it; it returns the loss and the
metric dict TRL stores), KTO's ``_compute_loss`` (it returns the loss and appends to ``self._metrics``). The
forward becomes ``model(..., strop_hidden_states=True)`` (:func:`~strop.kernels.trainers.add_hidden_states_head`)
and the loss scores the hidden states chunk by chunk; collation, reference handling, optimisation and logging
stay TRL's. A final-logit soft-cap (Gemma) is applied inside the chunked losses, as HF's forward applies it. A
configuration the chunked path does not cover runs TRL's own method, with the reason logged once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..losses.cpo import CPO_LOSS_TYPES, strop_cpo_loss
from ..losses.kto import KTO_LOSS_TYPES, kto_kl, strop_kto_loss
from ..losses.logps import sequence_logps
from ..losses.orpo import strop_orpo_loss
from ._glue import (
    DeviceNanFilter,
    final_logit_softcap,
    head_unsupported_reason,
    hf_model,
    reference_adapter,
    reference_pass,
    start_chunked_loss,
    trl_reference_helpers,
    unwrapped_model,
)
from .shared_prompt import PromptSharing

__all__ = [
    "StropCPOMixin",
    "StropKTOMixin",
    "StropORPOMixin",
    "strop_cpo_trainer_class",
    "strop_kto_trainer_class",
    "strop_orpo_trainer_class",
]


class _StropPreferenceMixin(DeviceNanFilter):
    """What the three mixins share: the reason check at construction, the hidden-states head, the LM head, HF's
    NaN filter on the device (``DeviceNanFilter``)."""

    _strop_method = "?"
    # ORPO and CPO: run each pair's prompt once (``shared_prompt.py``); False runs TRL's rows as they are
    strop_share_prompts: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strop_reason = self._strop_unsupported_reason()
        self._strop_sharing = PromptSharing(self._strop_method)
        start_chunked_loss(self, self._strop_method, self._strop_reason)

    @property
    def strop_shared_batches(self) -> int:
        """Batches whose pairs ran their prompt once (ORPO, CPO)."""
        return self._strop_sharing.batches

    def _strop_hf_model(self, model: Any) -> Any:
        return hf_model(self.accelerator, model)

    def _strop_method_reason(self) -> str | None:
        return None

    def _strop_unsupported_reason(self) -> str | None:
        reason = self._strop_method_reason()
        if reason:
            return reason
        if getattr(self, "is_encoder_decoder", False):
            return "encoder-decoder model"
        if getattr(self, "aux_loss_enabled", False):
            return "MoE router aux loss"
        return head_unsupported_reason(self.accelerator, self.model, "the chunked losses score")

    def _strop_head(self, model: Any | None = None) -> Any:
        return self._strop_hf_model(self.model if model is None else model).get_output_embeddings()

    def _strop_softcap(self, model: Any | None = None) -> float | None:
        """The model's final-logit soft-cap (HF: ``logits = c · tanh(logits / c)``), or None."""
        return final_logit_softcap(self._strop_hf_model(self.model if model is None else model))

    def _strop_hidden(self, model: Any, head: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = model(*args, **kwargs, strop_hidden_states=True).last_hidden_state
        return hidden.to(head.weight.device)  # a model split across devices can end elsewhere than its head

    def _strop_metrics(self, out: Any, train_eval: str) -> dict[str, float]:
        gather = self.accelerator.gather_for_metrics
        prefix = "eval_" if train_eval == "eval" else ""
        return {f"{prefix}{k}": v.item() for k, v in out.metrics(lambda t: gather(t).mean()).items()}

    def _strop_pairs(self, batch: dict[str, Any], padding_value: int) -> dict[str, torch.Tensor]:
        return self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=padding_value, device=self.accelerator.device
        )

    def _strop_pair_hidden(self, model: Any, head: Any, cb: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2B, T, H]`` hidden states of the concatenated pairs, each pair's prompt run once where it can be."""
        mask = cb["concatenated_attention_mask"]
        kwargs = {"input_ids": cb["concatenated_input_ids"], "attention_mask": mask, "use_cache": False}
        shared = None
        if self.strop_share_prompts and self._strop_softcap() is None and not bool(mask.all()):
            # TRL's logits/* metrics average every position, padding included, whose states a shared batch
            # does not compute: exact metrics need a batch without padding
            self._strop_sharing.unshared("padding positions enter TRL's logits/* means")
        elif self.strop_share_prompts:
            completion = cb["concatenated_labels"] != -100  # TRL masks prompt and padding labels with -100
            shared = self._strop_sharing.layout(self._strop_hf_model(self.model), kwargs, completion)
        if shared is None:
            return self._strop_hidden(model, head, **kwargs)
        return shared.unshare(self._strop_hidden(model, head, **shared.model_kwargs(), use_cache=False))


class StropORPOMixin(_StropPreferenceMixin):
    """Mix into TRL's ``ORPOTrainer``: :func:`strop_orpo_loss` on the backbone's hidden states (NLL and odds
    ratio from one chunked pass), the same loss and logged metrics (rewards/*, logps/*, logits/*, nll_loss,
    log_odds_ratio, log_odds_chosen). Falls back to TRL for an encoder-decoder model, MoE aux loss, a trainable
    or scaled LM head and prompt learning."""

    _strop_method = "ORPO"

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        if self._strop_reason:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        cb = self._strop_pairs(batch, self.padding_value)
        head = self._strop_head()
        dev = head.weight.device
        ids, mask = cb["concatenated_input_ids"], cb["concatenated_attention_mask"]
        hidden = self._strop_pair_hidden(model, head, cb)
        out = strop_orpo_loss(
            hidden,
            head.weight,
            ids.to(dev),
            mask.to(dev),
            cb["concatenated_labels"].to(dev),
            head.bias,
            beta=self.beta,
            softcap=self._strop_softcap(),
        )
        return out.loss, self._strop_metrics(out, train_eval)


class StropCPOMixin(_StropPreferenceMixin):
    """Mix into TRL's ``CPOTrainer``: :func:`strop_cpo_loss` (sigmoid, hinge, ipo, simpo; label smoothing;
    cpo_alpha's NLL) on the backbone's hidden states, with TRL's logged metrics. SimPO is ``loss_type="simpo"``
    with ``cpo_alpha=0``. Falls back to TRL for AlphaPO (``alpha != 0``), other loss types and the cases of
    :class:`StropORPOMixin`."""

    _strop_method = "CPO"

    def _strop_method_reason(self) -> str | None:
        if self.loss_type not in CPO_LOSS_TYPES:
            return f"loss_type {self.loss_type!r} (chunked CPO has {list(CPO_LOSS_TYPES)})"
        if getattr(self, "alpha", 0.0) != 0.0:
            return f"alpha={self.alpha} (AlphaPO reward shaping)"
        return None

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        if self._strop_reason:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        cb = self._strop_pairs(batch, self.pad_token_id)
        head = self._strop_head()
        hidden = self._strop_pair_hidden(model, head, cb)
        out = strop_cpo_loss(
            hidden,
            head.weight,
            cb["concatenated_labels"].to(head.weight.device),
            head.bias,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            simpo_gamma=getattr(self, "simpo_gamma", 0.0),
            cpo_alpha=self.cpo_alpha,
            softcap=self._strop_softcap(),
        )
        return out.loss, self._strop_metrics(out, train_eval)


# TRL 1.16's KTOTrainer._compute_loss: batch keys that are not model inputs (the main and the KL passes)
_KTO_NON_MODEL = frozenset(
    {
        "completion_mask",
        "KL_input_ids",
        "KL_attention_mask",
        "KL_completion_mask",
        "KL_token_type_ids",
        "KL_mm_token_type_ids",
        "label",
        "ref_logps",
        "ref_KL_logps",
    }
)


def _kto_trl_helpers() -> tuple[Any, Any]:
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    return disable_gradient_checkpointing, use_adapter


class StropKTOMixin(_StropPreferenceMixin):
    """Mix into TRL's ``KTOTrainer``: :func:`strop_kto_loss` on the backbone's hidden states; the KL estimate
    (mismatched prompt/completion pairs) and the reference (the PEFT model with its adapters disabled or its
    "ref" adapter, a ``ref_model``, or precomputed log-probs) scored chunk by chunk without gradients. Logs
    TRL's kl, num_tokens, logits/*, rewards/* and logps/*; TRL's entropy needs a second pass over the vocabulary
    and is not logged. Falls back to TRL for vision datasets, MoE aux loss, other loss types, a trainable or
    scaled LM head, prompt learning and ``return_outputs=True``."""

    _strop_method = "KTO"

    def _strop_method_reason(self) -> str | None:
        if self.loss_type not in KTO_LOSS_TYPES:
            return f"loss_type {self.loss_type!r} (chunked KTO has {list(KTO_LOSS_TYPES)})"
        if getattr(self, "_is_vision_dataset", False):
            return "vision dataset"
        return None

    def _strop_kl_kwargs(self, batch: dict[str, Any]) -> dict[str, Any]:
        kw = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL | {"input_ids", "attention_mask"}}
        kw.update(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"], use_cache=False)
        return kw

    def _strop_logps(self, model: Any, kwargs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        head = self._strop_head(model)
        hidden = self._strop_hidden(model, head, **kwargs)
        return sequence_logps(
            hidden, head.weight, labels.to(head.weight.device), head.bias, softcap=self._strop_softcap(model)
        )

    def _compute_loss(self, model, inputs, return_outputs):
        if self._strop_reason or return_outputs:
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        dev = self.accelerator.device
        batch = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=dev)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        kl_labels = None
        if self.calculate_KL:
            kl_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
        disable_gc, use_adapter = trl_reference_helpers(_kto_trl_helpers)

        kl_logps = None
        if self.calculate_KL:
            with torch.no_grad():  # TRL's KL term is detached: its policy pass runs without gradients
                kl_logps = self._strop_logps(model, self._strop_kl_kwargs(batch), kl_labels)
        model_kwargs = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL}
        model_kwargs["use_cache"] = False
        head = self._strop_head()
        hidden = self._strop_hidden(model, head, **model_kwargs)

        ref_kl = None
        if self.precompute_ref_logps:
            ref_logps = batch["ref_logps"]
            ref_kl = batch["ref_KL_logps"] if self.calculate_KL else None
        else:
            with (
                torch.no_grad(),
                reference_pass(self.model, disable_gc, self.args.gradient_checkpointing_kwargs),
            ):
                unwrapped = unwrapped_model(self.accelerator, self.model)
                peft_cfg = getattr(unwrapped, "peft_config", None)
                if self.ref_model is None and peft_cfg is not None:
                    ctx, ref_source = reference_adapter(unwrapped, peft_cfg, use_adapter), self.model
                else:
                    ctx, ref_source = contextlib.nullcontext(), self.ref_model
                with ctx:
                    if self.calculate_KL:
                        ref_kl = self._strop_logps(ref_source, self._strop_kl_kwargs(batch), kl_labels)
                    ref_logps = self._strop_logps(ref_source, model_kwargs, labels)

        gather = self.accelerator.gather_for_metrics
        kl = None
        if self.calculate_KL:
            kl = gather(kto_kl(kl_logps, ref_kl)).mean().clamp(min=0)
        out = strop_kto_loss(
            hidden,
            head.weight,
            labels.to(head.weight.device),
            desirable.to(head.weight.device),
            ref_logps=ref_logps,
            kl=kl,
            bias=head.bias,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
            loss_type=self.loss_type,
            softcap=self._strop_softcap(),
        )

        metrics = self._metrics[mode]
        if mode == "train":
            tokens = gather(batch["attention_mask"].sum()).sum().item()
            self._total_train_tokens += tokens // getattr(self, "_tp_size", 1)
        for key, value in out.metrics(lambda t: gather(t).nansum()).items():
            metrics[key].append(value)
        metrics["num_tokens"] = [self._total_train_tokens]
        return out.loss


_CLASSES: dict[str, type] = {}


def _trainer_class(name: str, mixin: type, load) -> type:
    if name not in _CLASSES:
        _CLASSES[name] = type(name, (mixin, load()), {"__module__": __name__})
    return _CLASSES[name]


def _orpo_trainer() -> type:
    from trl.experimental.orpo import ORPOTrainer

    return ORPOTrainer


def _cpo_trainer() -> type:
    from trl.experimental.cpo import CPOTrainer

    return CPOTrainer


def _kto_trainer() -> type:
    from trl import KTOTrainer

    return KTOTrainer


def strop_orpo_trainer_class() -> type:
    """``class StropORPOTrainer(StropORPOMixin, trl.experimental.orpo.ORPOTrainer)``, built on first use."""
    return _trainer_class("StropORPOTrainer", StropORPOMixin, _orpo_trainer)


def strop_cpo_trainer_class() -> type:
    """``class StropCPOTrainer(StropCPOMixin, trl.experimental.cpo.CPOTrainer)`` (SimPO: loss_type="simpo")."""
    return _trainer_class("StropCPOTrainer", StropCPOMixin, _cpo_trainer)


def strop_kto_trainer_class() -> type:
    """``class StropKTOTrainer(StropKTOMixin, trl.KTOTrainer)``, built on first use."""
    return _trainer_class("StropKTOTrainer", StropKTOMixin, _kto_trainer)
