"""Generating from a session's model (Generate, and the base's answers that retention replays): batched
``model.generate`` under a token cap and the caller's deadline, inside ``inference``: the autocast the session's
jobs train in (``LoadedModel.compute_autocast``), the output head's logits not rounded to 16 bits, and on a CPU
session a dequantized copy of the 4-bit weights to generate from."""

from __future__ import annotations

import contextlib
import logging

from strop.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from strop.trainer_svc.core.loaded_model import LoadedModel

log = logging.getLogger("strop.trainer")


MAX_GENERATE_TOKENS = 16_384  # per call, over all prompts: Generate shares the device with training


def generate(
    loaded: LoadedModel,
    prompts: list[str],
    *,
    max_new_tokens: int,
    disable_adapter: bool,
    apply_chat_template: bool,
    time_budget: float | None = None,
) -> list[str]:
    """Greedy completions of ``prompts`` (new text only, special tokens removed).

    Raises:
        DeadlineExceeded: ``time_budget`` seconds (the caller's deadline) ran out; generation stops there.
    """
    texts, _ = _generate(
        loaded,
        prompts,
        max_new_tokens=max_new_tokens,
        disable_adapter=disable_adapter,
        apply_chat_template=apply_chat_template,
        time_budget=time_budget,
    )
    return texts


def generate_chat(
    loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int, disable_adapter: bool
) -> tuple[list[str], list[bool]]:
    """Greedy answers to ``prompts`` as user messages, and whether each ended its turn (the tokenizer's end of
    sequence) within ``max_new_tokens``."""
    return _generate(
        loaded,
        prompts,
        max_new_tokens=max_new_tokens,
        disable_adapter=disable_adapter,
        apply_chat_template=True,
        time_budget=None,
    )


def _generate(
    loaded: LoadedModel,
    prompts: list[str],
    *,
    max_new_tokens: int,
    disable_adapter: bool,
    apply_chat_template: bool,
    time_budget: float | None,
) -> tuple[list[str], list[bool]]:
    import time

    if not prompts:
        raise InvalidArgument("no prompts given")
    if not 0 < max_new_tokens <= 4096:
        raise InvalidArgument(f"max_new_tokens must be in 1..4096, got {max_new_tokens}")
    if len(prompts) * max_new_tokens > MAX_GENERATE_TOKENS:
        raise InvalidArgument(
            f"{len(prompts)} prompts x {max_new_tokens} new tokens is above the {MAX_GENERATE_TOKENS} tokens "
            "one Generate call may produce; split the prompts"
        )
    deadline = None if time_budget is None else time.monotonic() + max(0.0, time_budget)
    tok = loaded.tokenizer
    if apply_chat_template:
        if not getattr(tok, "chat_template", None):
            raise FailedPrecondition("the model's tokenizer has no chat template")
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    else:
        texts = list(prompts)
    outs: list[str] = []
    finished: list[bool] = []
    with inference(loaded, disable_adapter=disable_adapter) as model:
        for text in texts:  # one at a time: no padding, so results do not depend on batch makeup
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"the deadline passed after {len(outs)} of {len(texts)} prompts")
            enc = tok(text, return_tensors="pt", add_special_tokens=not apply_chat_template).to(loaded.device)
            # HF stops generating at max_time
            out = _greedy(model, enc, tok, max_new_tokens, **({"max_time": left} if left is not None else {}))
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"the deadline passed during prompt {len(outs) + 1} of {len(texts)}")
            new = out[0, enc["input_ids"].shape[1] :]
            outs.append(tok.decode(new, skip_special_tokens=True))
            finished.append(bool(len(new)) and int(new[-1]) == tok.eos_token_id)
    return outs, finished


def _greedy(model, enc, tok, max_new_tokens: int, **kwargs):
    """HF's greedy decoding of ``enc`` with the KV cache, as Generate decodes."""
    return model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
        **kwargs,
    )


def generate_chat_batch(
    loaded: LoadedModel, prompts: list[str], *, max_new_tokens: int, disable_adapter: bool
) -> tuple[list[str], list[bool]]:
    """``generate_chat`` over all prompts at once (left-padded): one decoding pass for the batch, for the trainer's
    own use (retention). Padding may change a near-tie argmax, so an answer can differ from the unbatched one."""
    tok = loaded.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    side = tok.padding_side
    try:
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(loaded.device)
        with inference(loaded, disable_adapter=disable_adapter) as model:
            out = _greedy(model, enc, tok, max_new_tokens)
    finally:
        tok.padding_side = side
    answers, finished = [], []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        done = tok.eos_token_id in row
        answers.append(
            tok.decode(row[: row.index(tok.eos_token_id)] if done else row, skip_special_tokens=True)
        )
        finished.append(done)
    return answers, finished


@contextlib.contextmanager
def inference(loaded: LoadedModel, *, disable_adapter: bool = False):
    """Inside, ``loaded.model`` (yielded) computes as a session's forwards outside training do (Generate, the
    retention's teacher-forced scoring and sampling): eval mode, no autograd, the adapter off on request, a CPU
    session's 4-bit layers from their dequantized copy (``inference_weights``), the autocast the session's jobs
    train in (``LoadedModel.compute_autocast``) and the output head's logits in fp32 (``unrounded_logits``)."""
    import torch

    model = loaded.model
    adapter = (
        model.disable_adapter() if (disable_adapter and loaded.lora is not None) else contextlib.nullcontext()
    )
    was_training = model.training
    model.eval()
    try:
        with (
            adapter,
            torch.no_grad(),
            inference_weights(loaded),
            loaded.compute_autocast(),
            unrounded_logits(model, _head_copy(loaded)),
        ):
            yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def unrounded_logits(model, weight32=None):
    """Inside: the model's output head, where it is a plain ``nn.Linear``, returns its logits in fp32: the products
    the session computes (input and weight in the autocast dtype, else the input's) summed in fp32 and not rounded
    to 16 bits at the end, as autocast would give them (``kernels.ops.unrounded_linear``; the retention's KL term
    computes its logits the same way). Rounded, a logit between 16 and 32 moves in steps of 1/8 nat: two tokens a few
    hundredths of a nat apart tie, and greedy decoding takes the lower token id, whatever the model's sums prefer.
    ``weight32``: the head's weight so rounded, in fp32 (a CPU session's copy, ``inference``; the CPU has no
    fp32-output 16-bit GEMM). A head with a LoRA layer (a trained unembedding) is left as it is."""
    import torch

    from strop.kernels.ops.unrounded_linear import unrounded_linear

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # a head that is not plain, or one an outer call already patched, is left as it is
    if type(head) is not torch.nn.Linear or "forward" in head.__dict__:
        yield
        return

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unrounded_linear(x, self.weight, self.bias, weight32=weight32)

    head.forward = forward.__get__(head)
    try:
        yield
    finally:
        head.__dict__.pop("forward", None)


def _head_copy(loaded: LoadedModel):
    """A CPU session's output head weight as its jobs compute with it (in the autocast dtype, else its own) in fp32,
    for ``unrounded_logits``; None where there is nothing to copy (CUDA, an fp32 head, no plain head) or the copy would
    pass ``INFERENCE_COPY_HOST_SHARE`` of the host's available memory. Kept in ``loaded.extra`` until
    ``drop_inference_weights``, and made again if the head's weight is no longer the one copied."""
    if not loaded.device.startswith("cpu"):
        return None
    import torch

    head = loaded.model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None
    auto = loaded.autocast_dtype()
    dt = getattr(torch, auto) if auto else head.weight.dtype  # as unrounded_linear rounds it
    if dt == torch.float32:
        return None
    w = head.weight
    key = (w.data_ptr(), w._version, dt)
    kept = loaded.extra.get(INFERENCE_HEAD)
    if kept is not None and kept[0] == key:
        return kept[1]
    import psutil

    if w.numel() * 4 > psutil.virtual_memory().available * INFERENCE_COPY_HOST_SHARE:
        return None
    with torch.no_grad():
        copy = w.to(dt).float()
    loaded.extra[INFERENCE_HEAD] = (key, copy)
    return copy


# A CPU session's 4-bit layers generate from a dequantized copy of their weights: bitsandbytes' CPU path
# dequantizes every weight again at every decoding step. The copy costs 4 bytes a weight (fp32 compute) and is
# kept only while it takes at most this share of the host's available memory.
INFERENCE_COPY_HOST_SHARE = 0.25
INFERENCE_COPY = "inference_weights"
INFERENCE_HEAD = "inference_head"  # a CPU session's fp32 head (_head_copy), dropped with the copy


@contextlib.contextmanager
def inference_weights(loaded: LoadedModel):
    """Inside: on a CPU session, every bitsandbytes ``Linear4bit`` computes ``x @ W.T + b`` from a dequantized
    copy of its weight (in the layer's compute dtype) instead of dequantizing it on every call.

    The copy is exactly what bitsandbytes' training forward computes with (``dequantize_4bit`` then a linear:
    ``MatMul4Bit``), built once and kept in ``loaded.extra`` between Generate calls; ``drop_inference_weights``
    frees it (a job does, as it starts). The layers' own forwards are untouched outside the ``with``: nothing
    about training changes (``tests/trainer_svc/test_training_guards.py`` checks gradients after a Generate
    bitwise).
    """
    layers = _inference_copy(loaded)
    if not layers:
        yield
        return
    import torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, layers[self], bias).to(inp_dtype)

    mine = [m for m in layers if "forward" not in m.__dict__]  # not those an outer call patched
    try:
        for module in mine:
            module.forward = forward.__get__(module)
        yield
    finally:
        for module in mine:
            module.__dict__.pop("forward", None)


def _inference_copy(loaded: LoadedModel) -> dict:
    if not loaded.device.startswith("cpu"):
        return {}
    if INFERENCE_COPY in loaded.extra:
        return loaded.extra[INFERENCE_COPY]
    try:
        import bitsandbytes.functional as bnbf
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return {}
    import torch

    layers = [m for m in loaded.model.modules() if isinstance(m, Linear4bit)]
    if not layers:
        return {}
    dtype = getattr(torch, loaded.facts.compute_dtype or "float32")
    need = sum(m.weight.quant_state.shape.numel() for m in layers) * dtype.itemsize
    import psutil

    room = psutil.virtual_memory().available * INFERENCE_COPY_HOST_SHARE
    if need > room:
        log.info(
            "generating from the 4-bit weights: their %.1f GiB dequantized copy is above %.0f%% of the host's "
            "available memory",
            need / 2**30,
            INFERENCE_COPY_HOST_SHARE * 100,
        )
        loaded.extra[INFERENCE_COPY] = {}
        return {}
    copy = {}
    with torch.no_grad():
        for m in layers:
            if getattr(m.weight.quant_state, "packing_format_for_cpu", False):
                return {}  # another layout (keep_4bit_layers_trainable prevents it); generate as bitsandbytes does
            w = bnbf.dequantize_4bit(m.weight.data, m.weight.quant_state)
            copy[m] = w.to(m.compute_dtype or dtype)
    loaded.extra[INFERENCE_COPY] = copy
    log.info("generating from a %.1f GiB dequantized copy of the 4-bit weights", need / 2**30)
    return copy


def drop_inference_weights(loaded: LoadedModel) -> None:
    """Free the dequantized inference copy and the head's fp32 copy (a job starts training, the session closes)."""
    loaded.extra.pop(INFERENCE_COPY, None)
    loaded.extra.pop(INFERENCE_HEAD, None)
