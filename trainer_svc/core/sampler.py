"""Batched sampling from a session's model (the adapter active) with a static KV cache: Tinker's ``sample``.

One call decodes every request x ``num_samples`` together. Each request's prompt is prefilled once (left-padded to
the longest prompt) and its K/V stay once in the cache, shared by its samples (each sample's tokens go to its own block
of slots: ``decode_step.py``); then one token per row per step, all rows in step.

Sampled-token log-probs are ``log_softmax`` of the raw logits (temperature 1, no top-k/top-p), whatever the sampling
parameters: the distribution of the weights, not of the sampling procedure. Tinker's engine returns the same (its
cookbook PR #86, where J. Schulman notes the returned logprobs are the original model's, not the temperature-scaled
one's), and the RL losses use them as ``q`` against the learner's own log-probs, which are raw as well.

Sampling: temperature (0 → greedy argmax), then top-k, then top-p on the renormalised top-k distribution (HF's
order), then the exponential race (argmax of p / E with E ~ Exp(1), i.e. Gumbel-max) with E drawn from the request's
own ``torch.Generator`` (seeded from ``seed``; without one, from the global generator's next seed), ``[num_samples,
vocab]`` per step whatever else is in the batch: the same seed gives the same tokens in any batch composition, up
to floating-point differences between batch shapes (a near-tie can resolve differently when the GEMMs differ).

Stops: a stop token (``stop_token_ids`` plus the call's ``eos_token_ids``) is included in ``tokens`` with its
log-prob, as Tinker returns it (its cookbook parses replies by the stop token). A stop string (checked on the host
every ``check_every`` steps, on the text the tokenizer decodes from the sampled tokens) ends the sequence at the
token whose text completes it, that token included (tokens cannot be split; vLLM's token ids do the same). Whether
Tinker drops a matched stop string's tokens is not documented; cookbook's string-stop renderers look for the
string in the reply, which this keeps. ``stop_reason`` is ``"stop"`` for either, ``"length"`` at ``max_tokens``.

The model is put back as found: every module's train/eval flag, the attention implementation, requires_grad is
untouched (``torch.no_grad``; never ``inference_mode``, whose tensors would poison buffers reused by training).

The model side of a step (the static KV cache, the masks, the grouped decode attention, the CUDA-graphed
step) is ``decode_step.py``; on CUDA, if the graph capture fails the call decodes eagerly and says so in
``SampleStats``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from strop.common.errors import InvalidArgument
from strop.trainer_svc.core.decode_step import (
    DECODE_ATTENTION,
    DECODE_LAYOUT,
    DecodeLayout,
    DecodeSlots,
    DecodeStep,
    ModelParts,
    StaticKVCache,
    head_logits,
    masks,
    model_parts,
    register_decode_attention,
)
from strop.trainer_svc.core.loaded_model import autocast_dtype

log = logging.getLogger("strop.trainer.sampler")

__all__ = [
    "SampleRequest",
    "SampleResult",
    "SampleStats",
    "SampledSequence",
    "SamplingParams",
    "StopReason",
    "sample",
]

CHECK_EVERY = 16  # steps between host reads of the finished flags (each is a device sync)
# prompt positions per head matmul: bounds the [positions, vocab] logits held at once
PROMPT_LOGPROB_CHUNK = 1024


class StopReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # StopReason: "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None  # first entry None


@dataclass
class SampleStats:
    """What one ``sample`` call did (filled in when a ``stats`` object is passed)."""

    rows: int = 0
    steps: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cuda_graph: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- validation


def _validate(requests: list[SampleRequest], vocab: int, max_length: int | None, tokenizer) -> None:
    if not requests:
        raise InvalidArgument("no sample requests given")
    for i, r in enumerate(requests):
        where = f"request {i}"
        p = r.params
        if not r.prompt:
            raise InvalidArgument(f"{where}: prompt is empty")
        bad = next((t for t in r.prompt if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidArgument(f"{where}: prompt token {bad!r} is outside the vocabulary [0, {vocab})")
        if not (isinstance(r.num_samples, int) and r.num_samples >= 1):
            raise InvalidArgument(f"{where}: num_samples must be >= 1, got {r.num_samples!r}")
        if not (isinstance(p.max_tokens, int) and p.max_tokens >= 1):
            raise InvalidArgument(f"{where}: max_tokens must be >= 1, got {p.max_tokens!r}")
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            raise InvalidArgument(f"{where}: temperature must be finite and >= 0, got {p.temperature!r}")
        if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
            raise InvalidArgument(f"{where}: top_p must be in (0, 1], got {p.top_p!r}")
        if not (p.top_k == -1 or p.top_k >= 1):
            raise InvalidArgument(f"{where}: top_k must be -1 (off) or >= 1, got {p.top_k!r}")
        bad = next((t for t in p.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidArgument(f"{where}: stop token {bad!r} is outside the vocabulary [0, {vocab})")
        if p.stop_strings and tokenizer is None:
            raise InvalidArgument(f"{where}: stop strings need the session's tokenizer")
        if any(not s for s in p.stop_strings):
            raise InvalidArgument(f"{where}: a stop string is empty")
        if max_length is not None and len(r.prompt) + p.max_tokens > max_length:
            raise InvalidArgument(
                f"{where}: prompt of {len(r.prompt)} tokens + max_tokens {p.max_tokens} exceeds the session's "
                f"max length {max_length}"
            )


# ------------------------------------------------------------------------------------------------ sample


class _ModelState:
    """Everything a call changes on the model, recorded and put back."""

    def __init__(self, model, parts: ModelParts):
        self.model = model
        self.flags = [(m, m.training) for m in model.modules()]
        self.attn = [(c, c._attn_implementation_internal) for c in parts.configs]

    def restore(self) -> None:
        for m, flag in self.flags:
            m.training = flag
        for c, impl in self.attn:
            c._attn_implementation_internal = impl
            if hasattr(c, DECODE_LAYOUT):
                delattr(c, DECODE_LAYOUT)


@contextlib.contextmanager
def _decode_forwards(model, on: bool, rows: int):
    if not on:
        yield 0, []
        return
    from strop.kernels.models.decode import nf4_decode_forwards

    notes: list[str] = []
    with nf4_decode_forwards(model, notes, rows) as n:
        yield n, notes


def _compute_autocast(parts: ModelParts) -> contextlib.AbstractContextManager:
    """Autocast to the model's 16-bit compute dtype, as training runs (``step_ops``): a session keeps every weight
    that is not 4-bit in its compute dtype, the embedding included, and its LoRA factors in fp32. Without autocast a
    16-bit input meeting fp32 factors is PEFT's own arithmetic (the LoRA term in fp32), which strop's patched
    forwards leave to PEFT (``kernels/models/proj_spec.py``); under it they take strop's path and compute the LoRA
    term as training does. The cast cache stays off, as torch's CUDA-graph notes ask of autocast around a capture."""
    dtype = _compute_dtype(parts)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(
        parts.backbone.get_input_embeddings().weight.device.type, dtype=dtype, cache_enabled=False
    )


def _compute_dtype(parts: ModelParts) -> torch.dtype | None:
    """The 16-bit dtype a session computes in (its embedding's) where its jobs train under autocast to it
    (``loaded_model.autocast_dtype``: not fp16 off CUDA), or None (no autocast)."""
    w = parts.backbone.get_input_embeddings().weight
    name = autocast_dtype(str(w.dtype).removeprefix("torch."), w.device.type)
    return None if name is None else getattr(torch, name)


@contextlib.contextmanager
def _lora_factors_in(model, dtype: torch.dtype | None):
    """For the call, every fp32 LoRA factor of a linear (PEFT's ``lora_A``/``lora_B``) holds its value cast to the
    compute ``dtype``; the fp32 tensors go back after, as they were (the optimizer's parameters are the same
    objects throughout).

    Why: under autocast each use of an fp32 factor casts it to ``dtype`` (autocast's weight-cast cache stays off
    around a CUDA graph capture, ``_compute_autocast``), and PEFT casts the layer's input to the factor's dtype and
    back; with 16-bit factors those casts are no-ops. Replayed in every decode step's graph they were a kernel
    each, for every projection of every layer. The values are the same: the forward casts the factors to ``dtype``
    (round to nearest) either way. None: nothing changes (fp32 compute; the opt-in NF4 decode kernel, which takes
    fp32 factors); DoRA layers are left alone (their weight norm reads the factors in their own dtype)."""
    kept: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        if dtype is not None:
            for m in model.modules():
                factors = (getattr(m, "lora_A", None), getattr(m, "lora_B", None))
                if not all(isinstance(f, torch.nn.ModuleDict) for f in factors):
                    continue
                dora = getattr(m, "use_dora", None) or {}
                for f in factors:
                    for name, sub in f.items():
                        w = getattr(sub, "weight", None)
                        if (
                            dora.get(name)
                            or not isinstance(w, torch.nn.Parameter)
                            or w.dtype != torch.float32
                        ):
                            continue
                        kept.append((w, w.data))
                        w.data = w.data.to(dtype)
        yield len(kept)
    finally:
        for w, data in kept:
            w.data = data


def sample(
    model,
    requests: list[SampleRequest],
    *,
    tokenizer=None,
    eos_token_ids=(),
    max_length: int | None = None,
    cuda_graphs: bool = True,
    check_every: int = CHECK_EVERY,
    nf4_decode: bool = False,
    stats: SampleStats | None = None,
) -> list[SampleResult]:
    """Sample ``num_samples`` completions of each request from ``model`` (its active adapter), all in one batch.

    Args:
        model: A transformers causal LM (plain, PEFT-wrapped, patched by strop's kernels; 16-bit or NF4 base).
        requests: Prompts (token ids), sample counts and sampling parameters.
        tokenizer: Needed for stop strings (decoding the sampled tokens).
        eos_token_ids: Stop tokens for every request besides its own (Tinker's implicit EOS; pass ``()`` for its
            ``stop=[]``).
        max_length: The session's limit on prompt + ``max_tokens`` (default: the model's max positions).
        cuda_graphs: On CUDA, replay the decode step as a CUDA graph (falls back to eager if capture fails).
        check_every: Steps between host checks of the finished flags and the stop strings.
        nf4_decode: Decode an NF4 base's LoRA layers with the fused NF4 decode kernel
            (``strop.kernels.models.decode``) where it applies. Off by default: at 64 decode rows its GEMV tile
            measured slower than the model's own dequantize + GEMM forwards (bench/RESULTS.md, issue 34).
        stats: Filled in with what the call did.

    Returns:
        One ``SampleResult`` per request, in order; its sequences in sample order.

    Raises:
        InvalidArgument: a request names tokens outside the vocabulary, bad parameters, or exceeds ``max_length``.
        FailedPrecondition: the model's logits are not ``h Wᵀ`` (optionally soft-capped), so no raw log-probs.
    """
    parts = model_parts(model)
    config = parts.inner.config
    vocab = int(parts.head.weight.shape[0])
    if max_length is None:
        max_length = getattr(
            config.get_text_config() if hasattr(config, "get_text_config") else config,
            "max_position_embeddings",
            None,
        )
    _validate(requests, vocab, max_length, tokenizer)
    stats = stats if stats is not None else SampleStats()
    state = _ModelState(model, parts)
    try:
        model.eval()
        with (
            torch.no_grad(),
            _compute_autocast(parts),
            _lora_factors_in(model, None if nf4_decode else _compute_dtype(parts)),
            _decode_forwards(model, nf4_decode, sum(r.num_samples for r in requests)) as (swapped, notes),
        ):
            stats.extra["nf4_decode_layers"] = swapped
            stats.note = "; ".join(notes)
            return _sample(
                model, parts, requests, tokenizer, tuple(eos_token_ids), cuda_graphs, check_every, stats
            )
    finally:
        state.restore()


def _sample(model, parts, requests, tokenizer, eos, cuda_graphs, check_every, stats) -> list[SampleResult]:
    device = next(p for p in model.parameters()).device
    embed = parts.backbone.get_input_embeddings()
    dtype = embed.weight.dtype if embed.weight.is_floating_point() else torch.float32
    n_req = len(requests)
    vocab = int(parts.head.weight.shape[0])
    lengths = [len(r.prompt) for r in requests]
    prompt_len = max(lengths)
    max_new = max(r.params.max_tokens for r in requests)
    counts = [r.num_samples for r in requests]
    most = max(counts)
    # a request's prompt once, then one block of max_new slots per sample (decode_step.py)
    slots_total = prompt_len + most * max_new
    rows = sum(counts)
    row_req = torch.repeat_interleave(torch.arange(n_req), torch.tensor(counts)).to(device)
    stats.rows = rows
    stats.extra["kv_cache_slots"] = (
        n_req * slots_total
    )  # per layer and kv head: the prompts once, a block a sample

    # ---- prefill: one row per request, left-padded
    pads = [prompt_len - n for n in lengths]
    ids = torch.zeros(n_req, prompt_len, dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, pads[i] :] = torch.tensor(r.prompt, dtype=torch.long)
    ids = ids.to(device)
    pad_t = torch.tensor(pads, device=device)
    slot = torch.arange(slots_total, device=device)
    in_prompt = slot < prompt_len
    step_of = torch.where(in_prompt, -1, (slot - prompt_len) % max_new)  # [L]
    owner = torch.where(in_prompt, -1, (slot - prompt_len) // max_new)
    prompt_ok = in_prompt[None, :] & (slot[None, :] >= pad_t[:, None])  # [R, L]
    first_pos = (prompt_len - pad_t)[:, None]  # [R, 1] the position of a sample's first token
    key_pos = torch.where(in_prompt[None, :], slot[None, :] - pad_t[:, None], first_pos + step_of[None, :])
    prefill_slots = torch.arange(prompt_len, device=device)
    q_pos = key_pos[:, :prompt_len].clamp(min=0)
    cache = StaticKVCache(parts.layers, prefill_slots, slots_total)
    layout = DecodeLayout(most)
    layout.causal_prefill = (
        not any(pads)
        and parts.sliding is None
        and all(
            c._attn_implementation == "sdpa" and not getattr(c, "attn_logit_softcapping", None)
            for c in parts.configs
        )
    )
    stats.extra["prefill"] = "causal" if layout.causal_prefill else "masked"
    if layout.causal_prefill:  # decode_step.DecodeLayout: the causal kernel, no mask built
        register_decode_attention()
        for c in parts.configs:
            c._attn_implementation_internal = DECODE_ATTENTION
            setattr(c, DECODE_LAYOUT, layout)
        # transformers takes a 4-D mask as given (no mask of its own); the causal prefill reads none
        prefill_mask = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
    else:
        prefill_mask = masks(
            parts, prompt_ok[:, :prompt_len], key_pos[:, :prompt_len], prefill_slots, q_pos, dtype
        )
    t0 = time.perf_counter()
    out = parts.backbone(
        input_ids=ids,
        attention_mask=prefill_mask,
        position_ids=q_pos,
        use_cache=True,
        **{parts.cache_kw: cache},
    )
    hidden = out.last_hidden_state  # [R, P, H]
    prompt_lps: list[list[float | None] | None] = [None] * n_req
    for i, r in enumerate(requests):
        if r.prompt_logprobs:
            prompt_lps[i] = _prompt_logprobs(parts, hidden[i, pads[i] :], r.prompt)
    first = head_logits(parts, hidden[:, -1])  # [R, V]
    del out, hidden

    # ---- one row per sample: its first token from its request's prefill, its K/V into its own block
    logits = first.index_select(0, row_req)
    sample_of_row = torch.tensor([i for n in counts for i in range(n)], device=device)
    cache.rows = (row_req, prompt_len + sample_of_row * max_new)
    if any(
        n != most for n in counts
    ):  # positions request x sample; a missing sample repeats its request's first
        starts_at = [sum(counts[:i]) for i in range(n_req)]
        layout.padded = torch.tensor(
            [starts_at[r] + (i if i < counts[r] else 0) for r in range(n_req) for i in range(most)],
            device=device,
        )
        layout.unpadded = torch.tensor(
            [r * most + i for r in range(n_req) for i in range(counts[r])], device=device
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.prefill_s = time.perf_counter() - t0

    # ---- per-row sampling parameters (host-known, static for the call)
    def expand(xs, dt):  # one value per request -> one per row
        return torch.tensor(
            [x for x, n in zip(xs, counts, strict=True) for _ in range(n)], dtype=dt, device=device
        )

    temps = [r.params.temperature for r in requests]
    greedy = expand([t == 0 for t in temps], torch.bool)
    temp = expand([t if t > 0 else 1.0 for t in temps], torch.float32)[:, None]
    need_sort = any(r.params.top_k != -1 or r.params.top_p < 1 for r in requests if r.params.temperature > 0)
    top_k = expand([r.params.top_k if r.params.top_k > 0 else vocab for r in requests], torch.long)
    top_p = expand([r.params.top_p for r in requests], torch.float32)
    max_tok = expand([r.params.max_tokens for r in requests], torch.long)
    stop_sets = [sorted(set(r.params.stop_token_ids) | set(eos)) for r in requests]
    width = max(1, max(len(s) for s in stop_sets))
    stop_ids = expand([s + [-1] * (width - len(s)) for s in stop_sets], torch.long)  # [B, S]
    gens = []
    for r in requests:
        if r.params.temperature > 0:
            g = torch.Generator(device=device)
            # without a seed, one from the OS: torch.seed() would reseed the global generator training draws from
            g.manual_seed(r.params.seed if r.params.seed is not None else secrets.randbits(63))
            gens.append(g)
        else:
            gens.append(None)
    any_sampled = any(g is not None for g in gens)
    starts = [sum(counts[:i]) for i in range(n_req)]
    noise = torch.empty(rows, vocab, device=device, dtype=torch.float32)

    tokens = torch.zeros(rows, max_new, dtype=torch.long, device=device)
    lps = torch.zeros(rows, max_new, dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    by_token = torch.zeros(rows, dtype=torch.bool, device=device)
    end = torch.full((rows,), max_new, dtype=torch.long, device=device)
    string_rows = [b for b in range(rows) if requests[int(row_req[b])].params.stop_strings]
    string_end: dict[int, int] = {}

    def choose(logits: torch.Tensor, t: int) -> None:
        logp = torch.log_softmax(logits, dim=-1)
        scaled = logits / temp
        if need_sort:
            sv, si = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            sv = sv.masked_fill(ranks >= top_k[:, None], float("-inf"))
            p = torch.softmax(sv, dim=-1)
            sv = sv.masked_fill((p.cumsum(-1) - p) >= top_p[:, None], float("-inf"))  # the first always stays
            scaled = torch.full_like(scaled, float("-inf")).scatter(1, si, sv)
        for g, s, r in zip(gens, starts, requests, strict=True):
            if g is not None:
                noise[s : s + r.num_samples].exponential_(generator=g)
        tok = torch.argmax(logits, dim=-1)
        if any_sampled:
            tok = torch.where(greedy, tok, torch.argmax(scaled - noise.log(), dim=-1))
        tokens[:, t] = tok
        lps[:, t] = logp.gather(1, tok[:, None])[:, 0]
        hit = (tok[:, None] == stop_ids).any(dim=1)
        done = hit | (max_tok <= t + 1)
        newly = done & ~finished
        end.masked_fill_(newly, t + 1)  # in place: fewer launches a step than building each anew
        by_token.logical_or_(newly & hit)
        finished.logical_or_(done)
        ids_in.copy_(tok[:, None])

    # ---- decode
    ids_in = torch.zeros(rows, 1, dtype=torch.long, device=device)
    step_t = torch.zeros(
        1, dtype=torch.long, device=device
    )  # the step: the slot in a sample's block written next
    pos = first_pos.index_select(0, row_req).clone()  # [B, 1] the position of the token each row feeds next
    cache.slots = step_t
    slots = DecodeSlots(prompt_ok, owner, step_of, key_pos, first_pos.expand(n_req, most))
    step = DecodeStep(parts, cache, ids_in, pos, step_t, slots, dtype)
    for c in parts.configs:
        c._attn_implementation_internal = DECODE_ATTENTION
        setattr(c, DECODE_LAYOUT, layout)
    register_decode_attention()
    use_graph = cuda_graphs and device.type == "cuda"
    t1 = time.perf_counter()
    choose(logits, 0)
    steps = 1
    for t in range(1, max_new):
        if t % check_every == 0:
            _check_strings(string_rows, string_end, tokens, end, finished, t, requests, row_req, tokenizer)
            if bool(finished.all()):
                break
        if use_graph and step.graph is None and t >= 2:
            use_graph = step.capture(stats)  # the eager steps before it were its warm-up
        logits = step.run()
        choose(logits, t)
        steps += 1
    if string_rows:
        _check_strings(string_rows, string_end, tokens, end, finished, steps, requests, row_req, tokenizer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.decode_s = time.perf_counter() - t1
    stats.steps = steps
    stats.cuda_graph = step.graph is not None

    # ---- results
    end_l, by_token_l = end.tolist(), by_token.tolist()
    tok_l, lp_l = tokens[:, :steps].tolist(), lps[:, :steps].tolist()
    results = [SampleResult([], prompt_lps[i]) for i in range(n_req)]
    for b in range(rows):
        i = int(row_req[b])
        if b in string_end:  # found within the row's tokens up to its own end, so never past it
            n, reason = string_end[b], StopReason.STOP
        else:
            n, reason = min(end_l[b], steps), StopReason.STOP if by_token_l[b] else StopReason.LENGTH
        results[i].sequences.append(SampledSequence(tok_l[b][:n], lp_l[b][:n], str(reason)))
        stats.new_tokens += n
    return results


def _check_strings(string_rows, string_end, tokens, end, finished, t, requests, row_req, tokenizer) -> None:
    """Find stop strings in the rows' decoded tokens (the first ``t`` of each, or up to its end); a row whose text
    contains one ends at the token that completes it."""
    if not string_rows:
        return
    host = tokens[:, :t].tolist()
    end_l = end.tolist()
    for b in string_rows:
        if b in string_end:
            continue
        stops = requests[int(row_req[b])].params.stop_strings
        seq = host[b][: min(t, end_l[b])]
        if not any(s in tokenizer.decode(seq) for s in stops):
            continue
        lo, hi = 1, len(seq)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in tokenizer.decode(seq[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        string_end[b] = lo
        finished[b] = True


def _prompt_logprobs(parts: ModelParts, hidden: torch.Tensor, prompt: list[int]) -> list[float | None]:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from the prefill's hidden states (``[len(prompt), H]``)."""
    out: list[float | None] = [None]
    targets = torch.tensor(prompt[1:], device=hidden.device)
    for s in range(0, len(prompt) - 1, PROMPT_LOGPROB_CHUNK):
        logits = head_logits(parts, hidden[s : s + PROMPT_LOGPROB_CHUNK][: len(prompt) - 1 - s])
        lp = torch.log_softmax(logits, dim=-1).gather(1, targets[s : s + logits.shape[0], None])[:, 0]
        out.extend(lp.tolist())
    return out
