"""What the TRL glue mixins share: HF's ``logging_nan_inf_filter`` applied on the device (``DeviceNanFilter``),
step metrics kept on the device until they are logged (``DeviceMetrics``),
the hidden-states head (the model surgery: a reversible forward swap that returns the backbone output), the
PEFT/accelerate unwrapping, the LM-head and config checks that decide whether a chunked loss can replace TRL's,
the model's final-logit soft-cap, the reference forward's context
(the PEFT model with its adapters disabled, or its "ref" adapter; ``reference_pass``), and whether unshared batches'
widths go in buckets (``width_buckets``).

Host time. These run in every step, between the GPU's forwards, where the host's time is the GPU's idle time once its
queue drains. accelerate's ``unwrap_model`` walks every module looking for compiled regions, PEFT's
``disable_adapter`` walks them several times (and computes the model's adapter status), and TRL's
``disable_gradient_checkpointing`` walks them twice: on a LoRA model of 32 layers each walk covers thousands of
modules. So the unwrapped model is asked of accelerate once per model (``unwrapped_model``), a plain LoRA model's
adapters are switched off and on by their flags alone (``reference_adapter``), and where strop's offloaded checkpoint
runs the layers the checkpointing is left on (``reference_pass``): under ``no_grad`` it calls each layer directly.
Each computes what the walk it replaces computes (the tests compare them bit for bit).

Plain functions of a trainer or its accelerator and model, so each mixin keeps its own method names while the
chunked DPO and preference losses install, check and score a model the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..models.hf import Swaps, previous_forward, scaled_logits_reason, unwrap_peft

__all__ = [
    "DeviceMetrics",
    "DeviceNanFilter",
    "add_hidden_states_head",
    "final_logit_softcap",
    "head_unsupported_reason",
    "hf_model",
    "reference_adapter",
    "reference_pass",
    "remove_hidden_states_head",
    "start_chunked_loss",
    "trl_reference_helpers",
    "unwrapped_model",
    "width_buckets",
]

logger = logging.getLogger("strop.kernels")

_HEAD_KWARGS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "fused_lm_head")


class DeviceNanFilter:
    """Mixed into strop's TRL trainers: HF's ``logging_nan_inf_filter`` on the device.

    HF's loop applies the filter by reading the loss (``isnan``, ``isinf``) right after every backward is launched,
    before the gradient clipping and the optimizer's Python run: the host waits for the whole backward there, and
    the GPU then idles through that Python. ``training_step`` applies the same filter on the device instead (a
    non-finite loss adds the mean of the losses since the last log, which is what HF's ``_tr_loss`` update then
    adds), with HF's own filter off during ``train``; the user's setting is restored when training ends.
    """

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._strop_nan_filter, self.args.logging_nan_inf_filter = self.args.logging_nan_inf_filter, False
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = self._strop_nan_filter

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if getattr(self, "_strop_nan_filter", False) and hasattr(self, "_tr_loss"):
            # transformers 5.17-5.24 keep the running sum in _tr_loss
            mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean)
        return loss


class DeviceMetrics:
    """Mixed into strop's TRL trainers: TRL's per-step metrics kept as device tensors until ``log`` reads them.

    TRL's ``compute_loss`` reads each metric back with ``.item()`` between the forward and the backward: the host
    waits for the forward there and the GPU idles while it runs the Python that launches the backward. A mixin's
    loss appends the same values as 0-d device tensors to TRL's ``_metrics`` lists (and train-token counts through
    :meth:`_strop_hold_tokens`); ``log`` reads every held value in one read per metric and hands TRL the floats
    its ``.item()`` would have given, before TRL averages them. On the 8B SFT and DPO steps this measured no gain
    (the backward is launched right after the reads; bench/RESULTS.md); it stays because it is exact and leaves the
    host free to run ahead where nothing else reads back.
    """

    def _strop_hold_tokens(self, tokens: torch.Tensor) -> None:
        """A train-token count (a device tensor) for TRL's ``_total_train_tokens``, added at the next log."""
        held = self.__dict__.setdefault("_strop_tokens", [])
        held.append(tokens // getattr(self, "_tp_size", 1))

    def _strop_fold_tokens(self) -> None:
        """Add the held token counts to TRL's ``_total_train_tokens`` (one read) and its train ``num_tokens``."""
        held = self.__dict__.get("_strop_tokens")
        if held:
            self._total_train_tokens = getattr(self, "_total_train_tokens", 0) + int(torch.stack(held).sum())
            held.clear()
            # TRL sets train's every step; eval's stays what it was as the evaluation ran (a loss in eval mode
            # folds the held counts first)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._strop_fold_tokens()
        for metrics in self._metrics.values():
            for values in metrics.values():
                held = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
                if held:  # one read for each metric; each value the float TRL's .item() gives
                    for i, value in zip(held, torch.stack([values[i] for i in held]).tolist(), strict=True):
                        values[i] = value
        super().log(logs, start_time)


def add_hidden_states_head(model: Any) -> None:
    """Let ``model(..., strop_hidden_states=True)`` return the backbone output (``last_hidden_state``, after the
    final norm) without running the LM head. Other calls run the model's forward unchanged.

    ``model`` is the transformers causal LM (for PEFT, ``peft_model.get_base_model()``: PEFT forwards the
    keyword through). Idempotent; undone by :func:`remove_hidden_states_head`. The swapped forward keeps the
    original's signature, which HF's ``generate`` validates keyword arguments against.
    """
    if "_strop_hidden_head" in model.__dict__:
        return
    swaps = Swaps("hidden_head")

    def forward(self, *args, strop_hidden_states: bool = False, **kwargs):
        owner, previous = previous_forward(self, "hidden_head")
        if not strop_hidden_states or not owner.active:
            return previous(*args, **kwargs)
        for key in _HEAD_KWARGS:
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs)

    swaps.forward(model, forward)
    model.__dict__["_strop_hidden_head"] = swaps


def remove_hidden_states_head(model: Any) -> None:
    """Undo :func:`add_hidden_states_head` (a no-op when it is not installed)."""
    swaps = model.__dict__.pop("_strop_hidden_head", None)
    if swaps is not None:
        swaps.undo()


def start_chunked_loss(trainer: Any, method: str, reason: str | None) -> None:
    """At a mixin's construction: log ``reason`` (TRL's loss runs), or, when it is None, let the trainer's model
    and ``ref_model`` (if any) return their hidden states (:func:`add_hidden_states_head`)."""
    if reason:
        logger.warning("strop.kernels chunked %s off, TRL's loss runs: %s", method, reason)
        return
    add_hidden_states_head(hf_model(trainer.accelerator, trainer.model))
    if getattr(trainer, "ref_model", None) is not None:
        add_hidden_states_head(hf_model(trainer.accelerator, trainer.ref_model))


def unwrapped_model(accelerator: Any, model: Any) -> Any:
    """``accelerator.unwrap_model(model)``, asked of accelerate once per model object (module docstring): a wrapper,
    once made, keeps what it wraps, and a new wrapper is a new object."""
    cache = accelerator.__dict__.setdefault("_strop_unwrapped", {})
    entry = cache.get(id(model))
    if entry is None or entry[0] is not model:  # (the model is held, so its id is not reused)
        entry = cache[id(model)] = (model, accelerator.unwrap_model(model))
    return entry[1]


def hf_model(accelerator: Any, model: Any) -> Any:
    """The transformers model under accelerate's wrapper and PEFT's."""
    return unwrap_peft(unwrapped_model(accelerator, model))


def width_buckets(trainer: Any) -> bool:
    """``shared_prompt.WIDTH_BUCKETS`` for this trainer: as set, or (None) whether cuDNN's SDPA may run its
    attention: a CUDA device, 16-bit compute, cuDNN's SDPA enabled, the model's attention ``sdpa``."""
    from . import shared_prompt

    if shared_prompt.WIDTH_BUCKETS is not None:
        return shared_prompt.WIDTH_BUCKETS
    args, model = trainer.args, hf_model(trainer.accelerator, trainer.model)
    half = args.bf16 or args.fp16 or model.dtype in (torch.float16, torch.bfloat16)
    return (
        args.device.type == "cuda"
        and half
        and torch.backends.cuda.cudnn_sdp_enabled()
        and getattr(model.config, "_attn_implementation", None) == "sdpa"
    )


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def final_logit_softcap(hf: Any) -> float | None:
    """The model's final-logit soft-cap (HF: ``logits = c · tanh(logits / c)``), or None."""
    softcap = getattr(_text_config(hf.config), "final_logit_softcapping", None)
    return None if softcap is None else float(softcap)


def head_unsupported_reason(accelerator: Any, model: Any, scorer: str) -> str | None:
    """Why a chunked loss cannot score ``model``'s LM head (None: it can).

    Args:
        accelerator: The trainer's accelerator (``unwrap_model``).
        model: The trainer's (possibly wrapped, possibly PEFT) model.
        scorer: Subject of the scaled-logits reason, e.g. ``"chunked DPO scores"``.
    """
    hf = hf_model(accelerator, model)
    head = hf.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return "no plain LM head weight"
    if head.weight.requires_grad or (getattr(head, "bias", None) is not None and head.bias.requires_grad):
        return "trainable LM head"
    scaled = scaled_logits_reason(hf.config)
    if scaled:
        return f"{scaled}; {scorer} unscaled logits"
    peft_cfg = getattr(unwrapped_model(accelerator, model), "peft_config", {})
    if any(getattr(c, "is_prompt_learning", False) for c in peft_cfg.values()):
        return "PEFT prompt learning (virtual tokens)"
    return None


@contextlib.contextmanager
def _gradient_checkpointing_as_is(model: Any, kwargs: Any = None) -> Iterator[None]:
    yield


def trl_reference_helpers(load: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``load()``'s TRL (``disable_gradient_checkpointing``, ``use_adapter``); on other TRL layouts (ImportError)
    the same behaviour by simpler means: checkpointing left as is, and no ``use_adapter`` (None)."""
    try:
        return load()
    except ImportError:
        return _gradient_checkpointing_as_is, None


def reference_adapter(unwrapped: Any, peft_cfg: dict[str, Any], use_adapter: Any) -> Any:
    """The context in which the PEFT model ``unwrapped`` is its own reference: its "ref" adapter if it has one,
    else its adapters disabled: by their flags where :func:`_adapter_flags` can (a plain LoRA model), else TRL's
    ``use_adapter`` where available, else PEFT's ``disable_adapter``."""
    name = "ref" if "ref" in peft_cfg else None
    if name is None:
        layers = _adapter_flags(unwrapped)
        if layers is not None:
            return _adapters_off(unwrapped, layers)
    return use_adapter(unwrapped, adapter_name=name) if use_adapter else unwrapped.disable_adapter()


def _flag_only_switches() -> tuple[Callable, ...]:
    """The ``enable_adapters`` methods that change nothing a forward reads but the layer's ``_disable_adapters`` flag
    (the rest is their parameters' ``requires_grad``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return (
        BaseTunerLayer.enable_adapters,
        AuxiliaryTrainingWrapper.enable_adapters,
        ModulesToSaveWrapper.enable_adapters,
    )


def _adapter_flags(peft_model: Any) -> list[Any] | None:
    """The adapter layers of a plain LoRA ``peft_model`` whose ``_disable_adapters`` flags alone make it the base
    model, as PEFT's ``disable_adapter()`` does: every config LoRA without trained biases (PEFT warns there, and its
    forward differs), every layer enabled and unmerged, every layer's ``enable_adapters`` PEFT's own flag switch (a
    layer class with its own does more). None where any of that does not hold: PEFT's walk runs.

    The layers are found once per set of adapters and targets (one walk) and kept on the model. PEFT's switch also
    sets the adapters' ``requires_grad`` (off, then on for the active adapter); under ``no_grad`` no forward reads
    it, and this leaves it as it was."""
    from peft import PeftType
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    configs = getattr(peft_model, "peft_config", None)
    if not configs or getattr(peft_model, "_adapters_disabled", False):
        return None
    if any(
        getattr(c, "peft_type", None) != PeftType.LORA or getattr(c, "bias", "none") != "none"
        for c in configs.values()
    ):
        return None
    # the adapters and what they target: adding an adapter (even under a deleted one's name) on other modules wraps
    # other layers, and PEFT appends those to its targeted names
    tuner = getattr(peft_model, "base_model", None)
    key = (
        tuple(configs),
        tuple(getattr(tuner, "targeted_module_names", None) or ()),
        tuple(getattr(tuner, "targeted_parameter_names", None) or ()),
        tuple(sorted(getattr(peft_model, "modules_to_save", None) or ())),
    )
    cached = peft_model.__dict__.get("_strop_adapter_flags")
    if cached is None or cached[0] != key:
        layers = [
            m for m in peft_model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))
        ]
        switches = _flag_only_switches()
        plain = bool(layers) and all(type(m).enable_adapters in switches for m in layers)
        cached = peft_model.__dict__["_strop_adapter_flags"] = (key, layers if plain else None)
    layers = cached[1]
    if layers is None or any(m._disable_adapters or getattr(m, "merged", False) for m in layers):
        return None
    return layers


@contextlib.contextmanager
def _adapters_off(peft_model: Any, layers: list[Any]) -> Iterator[None]:
    was = getattr(peft_model, "_adapters_disabled", False)
    for m in layers:
        m._disable_adapters = True
    peft_model._adapters_disabled = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False
        peft_model._adapters_disabled = was


def reference_pass(model: Any, disable_gc: Any, kwargs: Any) -> contextlib.AbstractContextManager:
    """TRL's ``disable_gradient_checkpointing(model, kwargs)`` around a reference forward under ``no_grad``, or
    nothing where strop's offloaded checkpoint runs ``model``'s layers: without grad it calls each layer as it is
    (``kernels/models/offload.py``), so the toggle (HF's walk over every module, twice) would change nothing
    computed."""
    if "_strop_offload" in unwrap_peft(model).__dict__:
        return contextlib.nullcontext()
    return disable_gc(model, kwargs)
