"""One decode step of a causal LM over a static KV cache, for the sampler (``sampler.py``).

Cache and masks. :class:`StaticKVCache` holds ``[requests, kv_heads, slots, head_dim]`` buffers per layer, allocated
once: a request's prompt (left-padded to the longest) once, then one block of ``max_tokens`` slots per sample (as many
blocks as the request with the most samples has), so a request's samples share its prompt's K/V instead of each
holding a copy (at a 64K prompt and 8 samples, 1/8 of the cache; the decode attention reads the prompt once per
request). The prefill writes the prompt slots; decode step ``t`` writes sample ``i``'s token into slot
``prompt + i·max_tokens + t`` of its request, with device-held indices, so nothing about a step depends on host
values. The 4-D additive masks the model receives hide pads, slots not yet written, other samples' slots and
(sliding-window layers) keys outside the window; position ids are per row. A padded query (prefill only) sees
itself, so no softmax row is empty.

Decode attention. HF's SDPA path repeats K/V to every query head when a mask is given (its ``use_gqa_in_sdpa``),
copying the whole cache per layer and step; for one query token per row the grouped product is computed directly
instead (``gqa_decode_attention``, registered as an attention implementation for the duration of a call; prefill
keeps the model's own implementation): a request's samples and each kv head's query heads become the query positions
of one attention over that request's slots, the mask telling each sample its own. On CUDA (``split_over_keys``)
that attention is ``kernels/ops/decode_attention.py``'s, split over the slots, since a flash kernel gives the few
query rows of each kv head one program that walks the whole prompt alone; elsewhere (and for a logit soft-cap) SDPA
or the plain product.

On CUDA the decode step (backbone + head, :class:`DecodeStep`) is captured once per call as a CUDA graph and
replayed; if capture fails the call decodes eagerly and says so in the sampler's stats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from strop.common.errors import FailedPrecondition

log = logging.getLogger("strop.trainer.sampler")

DECODE_ATTENTION = "strop_gqa_decode"
DECODE_LAYOUT = (
    "_strop_decode_layout"  # the config attribute the decode attention reads the rows' layout from
)


@dataclass
class DecodeLayout:
    """Where each sampled row's query sits among its request's ``samples`` positions (the most samples any request
    has): ``padded`` [requests·samples] the row filling each position (a request with fewer samples repeats its
    first row, masked to its prompt and dropped after), ``unpadded`` [rows] each row's position; both None when
    every request has ``samples`` samples (rows are already in that order). ``causal_prefill``: the prefill's
    prompts are unpadded and the model's attention is plain SDPA without a window, so the prefill runs SDPA's causal
    kernel (flash/cuDNN on CUDA) with no mask built (a [P, P] one is 32 GiB at a 128K prompt)."""

    samples: int
    padded: torch.Tensor | None = None
    unpadded: torch.Tensor | None = None
    causal_prefill: bool = False


class StaticKVCache:
    """Preallocated K/V per layer, written at device-held slots; what HF attention calls as its cache.

    HF attention calls ``update(key, value, layer_idx, ...)`` (the rest differs between transformers versions and
    is ignored) and attends over what it returns: the layer's whole buffers ``[requests, kv_heads, slots, dim]``,
    the mask hiding what is not yet written. Prefill: ``slots`` (a device tensor, the first slots) says where the
    prompt's tokens go, one buffer row per request, and attention reads the prompt slots only. Decode (``rows`` set): each sampled row's token goes to its request
    (``rows[0]``) at slot ``rows[1] + slots`` (its block's start plus the step, ``slots`` then holding the step)."""

    is_compileable = False

    def __init__(self, num_layers: int, slots: torch.Tensor, length: int):
        # read by transformers 5.17's mask builder to pick a full-attention layer (the masks passed are used as is)
        self.is_sliding = [False] * num_layers
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.slots = slots
        self.length = length
        self.prompt = int(slots.numel())  # the prefill attends over the prompt slots only
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None
        # decode: the slot each row writes this step, set once a step by DecodeStep (one add, not one a layer)
        self.at: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.k[layer_idx] is None:
            b, h, _, d = key.shape
            self.k[layer_idx] = key.new_zeros(b, h, self.length, d)
            self.v[layer_idx] = value.new_zeros(b, h, self.length, value.shape[-1])
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.rows is None:
            k.index_copy_(2, self.slots, key.to(k.dtype))
            v.index_copy_(2, self.slots, value.to(v.dtype))
            return k[:, :, : self.prompt], v[:, :, : self.prompt]
        request, start = self.rows  # decode: one token per sampled row, key [rows, kv_heads, 1, dim]
        at = self.at if self.at is not None else start + self.slots
        k[request, :, at] = key[:, :, 0].to(k.dtype)
        v[request, :, at] = value[:, :, 0].to(v.dtype)
        return k, v

    # what HF may ask a cache besides update (transformers 5.17 reads the length for its default positions)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.k)


# device → why the split kernel is not used there, found by its first call in the process (a compile failure or a
# result unlike SDPA's); devices whose first call passed. Written once per device, before any capture.
SPLIT_REFUSED: dict[str, str] = {}
_SPLIT_CHECKED: set[str] = set()


def _split_attention(q, key, value, rows, g: int, scale: float) -> torch.Tensor | None:
    """The split kernel's attention, or None where it is refused. A device's first call also runs SDPA and compares
    (a host sync, in the call's eager steps before any capture): an exception or a result off by more than 1% of
    SDPA's largest output refuses the kernel on that device for the process, with a warning."""
    from strop.kernels.ops.decode_attention import decode_attention

    dev = str(q.device)
    if dev in _SPLIT_CHECKED:
        return decode_attention(q, key, value, rows, g, scale)
    if dev in SPLIT_REFUSED:
        return None
    try:
        out = decode_attention(q, key, value, rows, g, scale)
        mask = None if rows is None else rows.repeat_interleave(g, dim=1)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
        err, bound = float((out.float() - ref.float()).abs().max()), 0.01 * float(ref.float().abs().max())
        if not err <= bound:
            raise ValueError(f"differs from SDPA by {err:.3g} (bound {bound:.3g})")
    except Exception as exc:  # any failure of the kernel: SDPA serves the process instead
        SPLIT_REFUSED[dev] = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("split decode attention refused on %s, SDPA instead: %s", dev, SPLIT_REFUSED[dev])
        return None
    _SPLIT_CHECKED.add(dev)
    return out


def split_over_keys(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the decode attention runs ``kernels/ops/decode_attention.py``'s kernel: on CUDA. (Under the Triton
    interpreter it would run too, but its programs run one by one: the CPU tests take it on purpose, one call.)"""
    from strop.kernels.ops.decode_attention import decode_attention_can_run

    return q.is_cuda and decode_attention_can_run(q, key, value)


def gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for one query token per sampled row over its request's slots of a grouped-query cache, without
    repeating K/V per query head or per sample.

    ``query`` ``[B, H, 1, D]`` (B sampled rows), ``key``/``value`` ``[R, Hkv, L, D]`` (R requests; query head ``h``
    reads kv head ``h // g``, g = H/Hkv, as HF's ``repeat_kv`` pairs them), ``attention_mask`` additive
    ``[R, 1, S, L]`` (S = samples a request, the config's :class:`DecodeLayout`). A request's S samples times a kv
    head's g query heads become that kv head's S·g query positions, so plain SDPA over Hkv heads computes it, each
    sample's mask row repeated over its g heads. Returns ``([B, 1, H, D], None)`` as HF's attention functions do.
    Longer queries (prefill) go to HF's SDPA.
    """
    if query.shape[2] != 1:
        lay = getattr(module.config, DECODE_LAYOUT, None)
        if lay is not None and lay.causal_prefill:  # the cache returned the prompt slots: keys = queries
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
            )
            return out.transpose(1, 2).contiguous(), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    lay: DecodeLayout = getattr(module.config, DECODE_LAYOUT)
    h, d = query.shape[1], query.shape[3]
    n_req, hkv, length = key.shape[0], key.shape[1], key.shape[2]
    g, s, dv = h // hkv, lay.samples, value.shape[-1]
    scale = scaling if scaling is not None else d**-0.5
    if lay.padded is not None:
        query = query.index_select(0, lay.padded)
    q = query.reshape(n_req, s, hkv, g, d).transpose(1, 2).reshape(n_req, hkv, s * g, d)
    softcap = kwargs.get("softcap")
    out = None
    if not softcap and split_over_keys(q, key, value):  # K/V read in place
        rows = None if attention_mask is None else attention_mask[:, 0, :, :length]  # [R, S, L], a view
        out = _split_attention(q, key, value, rows, g, scale)
    if out is not None:
        out = out.reshape(n_req, hkv, s, g, dv).transpose(1, 2).reshape(n_req * s, 1, h, dv)
        return (out if lay.unpadded is None else out.index_select(0, lay.unpadded)), None
    mask = None if attention_mask is None else attention_mask[:, :, :, :length].repeat_interleave(g, dim=2)
    if not softcap:  # SDPA's own kernels (fp32 softmax inside), K/V read in place
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    else:  # Gemma 2's logit soft-cap, which SDPA has no argument for
        scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask.float()
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    out = out.reshape(n_req, hkv, s, g, dv).transpose(1, 2).reshape(n_req * s, 1, h, dv)
    return (out if lay.unpadded is None else out.index_select(0, lay.unpadded)), None


@dataclass
class ModelParts:
    inner: Any  # the transformers *ForCausalLM
    backbone: Any
    head: Any
    softcap: float | None
    cache_kw: str  # "cache" (transformers >= 5.2x) or "past_key_values"
    layers: int
    sliding: int | None  # window of the sliding layers, if any
    layer_types: tuple[str, ...] | None  # per-layer "full_attention"/"sliding_attention": masks go in a dict
    configs: list  # every config whose _attn_implementation the attention modules read


def model_parts(model) -> ModelParts:
    import inspect

    from strop.kernels.models.hf import scaled_logits_reason, unwrap_peft

    inner = unwrap_peft(model)
    backbone = getattr(inner, getattr(inner, "base_model_prefix", "model"), None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if backbone is None or head is None:
        raise FailedPrecondition(f"cannot sample from {type(inner).__name__}: no backbone or LM head")
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    reason = scaled_logits_reason(config)
    if reason:
        raise FailedPrecondition(f"cannot sample from this model: {reason}")
    params = inspect.signature(backbone.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    layer_types = tuple(getattr(config, "layer_types", None) or ()) or None
    window = getattr(config, "sliding_window", None)
    sliding = None
    if layer_types and "sliding_attention" in layer_types:
        sliding = int(window)
    elif layer_types is None and window and getattr(config, "use_sliding_window", True):
        sliding = int(window)  # Mistral: every layer slides, one mask
    if layer_types and "sliding_attention" not in layer_types:
        layer_types = None
    configs, seen = [], set()
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation_internal") and id(c) not in seen:
            seen.add(id(c))
            configs.append(c)
    softcap = getattr(config, "final_logit_softcapping", None)
    return ModelParts(
        inner,
        backbone,
        head,
        float(softcap) if softcap else None,
        cache_kw,
        int(config.num_hidden_layers),
        sliding,
        layer_types,
        configs,
    )


def head_logits(parts: ModelParts, hidden: torch.Tensor) -> torch.Tensor:
    logits = parts.head(hidden).float()
    if parts.softcap:
        logits = torch.tanh(logits / parts.softcap) * parts.softcap
    return logits


def _mask(
    valid: torch.Tensor,  # [B, L] bool: slot holds a token of the row (not a pad)
    key_pos: torch.Tensor,  # [B, L] position of each slot
    q_slots: torch.Tensor,  # [Q] slots of the queries
    q_pos: torch.Tensor,  # [B, Q] positions of the queries
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    slots = torch.arange(valid.shape[1], device=valid.device)
    seen = slots[None, :] <= q_slots[:, None]  # [Q, L] causal over slots: nothing not yet written
    allowed = valid[:, None, :] & seen[None]  # [B, Q, L]
    if window is not None:
        allowed = allowed & ((q_pos[:, :, None] - key_pos[:, None, :]) < window)
    allowed = allowed | (slots[None, None, :] == q_slots[None, :, None])  # a (padded) query sees itself
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=valid.device)
    return torch.where(allowed, zero, low)[:, None]  # [B, 1, Q, L]


def masks(parts: ModelParts, valid, key_pos, q_slots, q_pos, dtype):
    full = _mask(valid, key_pos, q_slots, q_pos, None if parts.layer_types else parts.sliding, dtype)
    if not parts.layer_types:
        return full
    return {
        "full_attention": full,
        "sliding_attention": _mask(valid, key_pos, q_slots, q_pos, parts.sliding, dtype),
    }


@dataclass
class DecodeSlots:
    """What each decode step's masks are built from, fixed for a call (device tensors; R requests, L slots, S samples
    a request): ``prompt_ok`` [R, L] the prompt slots holding a token (not a pad), ``owner`` [L] the sample whose
    block a slot is in (-1: the prompt), ``step_of`` [L] the step that writes it (-1: the prompt), ``key_pos`` [R, L]
    each slot's position, ``first_pos`` [R, S] the position of each sample's first token."""

    prompt_ok: torch.Tensor
    owner: torch.Tensor
    step_of: torch.Tensor
    key_pos: torch.Tensor
    first_pos: torch.Tensor


def _decode_mask(d: DecodeSlots, step: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    samples = torch.arange(d.first_pos.shape[1], device=step.device)
    own = (d.owner[None, :] == samples[:, None]) & (d.step_of[None, :] <= step)  # [S, L]: written, its own
    allowed = d.prompt_ok[:, None, :] | own[None]  # [R, S, L]
    if window is not None:
        q_pos = d.first_pos + step  # [R, S]
        allowed = allowed & ((q_pos[:, :, None] - d.key_pos[:, None, :]) < window)
    zero = torch.zeros((), dtype=dtype, device=step.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=step.device)
    return torch.where(allowed, zero, low)[:, None]  # [R, 1, S, L]


def decode_masks(parts: ModelParts, d: DecodeSlots, step: torch.Tensor, dtype: torch.dtype):
    """The masks of decode step ``step`` (a device tensor): a sample's query sees its request's prompt and the
    tokens its own block holds so far (the one written this step included), within the window on sliding layers."""
    full = _decode_mask(d, step, None if parts.layer_types else parts.sliding, dtype)
    if not parts.layer_types:
        return full
    return {"full_attention": full, "sliding_attention": _decode_mask(d, step, parts.sliding, dtype)}


def register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, gqa_decode_attention)


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream per device to capture on (capture cannot run on the default stream), kept for the process."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[device]


class DecodeStep:
    """One decode step over static buffers: the step's masks, the model, the head; then the step and the positions
    advance. Everything it reads and writes lives on the device, so the same step replays as a CUDA graph."""

    def __init__(self, parts, cache, ids, pos, step, slots: DecodeSlots, dtype):
        self.parts, self.cache, self.ids, self.pos, self.step = parts, cache, ids, pos, step
        self.slots, self.dtype = slots, dtype
        self.graph = None
        self.out: torch.Tensor | None = None

    def _step(self) -> torch.Tensor:
        parts = self.parts
        mask = decode_masks(parts, self.slots, self.step, self.dtype)
        self.cache.at = self.cache.rows[1] + self.step  # the rows' slots this step, for every layer's write
        out = parts.backbone(
            input_ids=self.ids,
            attention_mask=mask,
            position_ids=self.pos,
            use_cache=True,
            **{parts.cache_kw: self.cache},
        )
        logits = head_logits(parts, out.last_hidden_state[:, -1])
        self.step.add_(1)
        self.pos.add_(1)
        return logits

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.out

    def capture(self, stats) -> bool:
        """Capture the step as a CUDA graph; False (and eager from here on) if this model's step cannot be."""
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Captured by hand rather than under ``torch.cuda.graph``, whose entry empties the device allocator's
            # cache and the pinned host allocator's: a GRPO step samples (one capture) between training passes,
            # and an emptied host cache made the next pass's activation offload allocate and free every pinned
            # block anew (cudaHostAlloc/cudaFreeHost are slow and stall the GPU). Capture needs neither emptied:
            # the graph draws from its own private pool. thread_local: another session's work on this device
            # from another thread is not captured (in torch 2.11 its CUDA RNG calls raise while the capture runs:
            # the default generator is marked capturing; kernels/models/step_graph.py).
            # (one capture at a time in the process: the training step's graphs take the same lock)
            from strop.kernels.models.step_graph import CAPTURE_LOCK

            with CAPTURE_LOCK, torch.cuda.stream(_capture_stream(self.ids.device)):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = self._step()
                finally:
                    graph.capture_end()
            self.graph, self.out = graph, out
            return True
        except Exception as exc:  # a host sync or an uncapturable op somewhere in the model's forward
            note = f"CUDA graph capture failed, decoding eagerly: {type(exc).__name__}: {exc}"[:500]
            stats.note = f"{stats.note}; {note}" if stats.note else note
            log.warning("%s", note)
            self.graph = None
            torch.cuda.synchronize()
            return False
