"""Verification: load each output in its consumer and compare it with the merged torch model and with
the model as trained.

The reference is the merged model in fp32 (the merge base's weights, 4-bit ones dequantized to fp32,
+ ``s·B@A``, never cast), evaluated with transformers. The second reference is the model as trained:
the session's base as the trainer loaded it (for a base quantized to NF4 on load, its NF4 codes
re-created bit for bit and dequantized to fp32; a prequantized base dequantized) with the adapter
*unmerged*, run by PEFT in fp32 (``as_trained_model``). With the default merge (AS_TRAINED) the two
references compute the same function and differ by fp32 rounding; merged onto the original 16-bit
weights of an NF4 session they differ by the quantization error, which ``Verification.as_trained``
shows. Every output is run on the same token ids (HF's tokenization, so the comparison is about
weights, not tokenizers) and compared:

- max and mean |Δlogit| over every position of a fixed prompt set, and top-1 agreement;
- perplexity on held-out text, reference vs output (``perplexity_delta = output − reference``);
- for GGUF: whether llama.cpp's own tokenizer gives HF's ids for the prompts and the held-out text
  (``tokens_match``), and for the chat-formatted question (``chat_tokens_match``);
- with a probe question/answer (what the adapter was trained to say): greedy generation from the
  chat-formatted question (``answer_reproduced``), and teacher-forced top-1 agreement with the answer
  tokens (``answer_top1_agreement``), the judge for quantized files — a random base's logits are
  nearly flat, so logit deltas on random prompts say little about a quantizer.

A check that does not run leaves its figure None ("not checked"): ``tokens_match`` of a merged or
PEFT output (HF's own tokenizer is its tokenizer), the answer figures without a probe question.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strop.common import hf_build
from strop.common.archs import SlidingWindow, arch_of
from strop.common.export_types import Comparison, Verification, VerifyOptions
from strop.common.serde import to_dict
from strop.export_svc.core import moe
from strop.export_svc.core.adapter_source import Adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import ConsumerRejected
from strop.export_svc.core.merge import iter_merged

DEFAULT_PROMPTS = (
    "The old engine repairs the final answer before sunrise.",
    "Hello, world! How are you today?",
    "A small cat watches the northern road with great care.",
    "What is the password? 42 after the storm.",
    "def f(x):\n    return x * 2",
    "Our team counts twelve apples every single day.",
    "The library explains a long letter near the harbour.",
    "1 + 2 = 3, and 20 + 21 = 41.",
    # longer than a small sliding window (the Gemma fixtures' 16 tokens): sliding layers see a truncated context
    # here, so a GGUF whose window, layer pattern or local RoPE differs from HF's shows in the logits
    "The river follows the morning train for the first time, and a quiet town remembers the secret map at the "
    "end of the week while every sailor finds a golden key without a sound.",
)
DEFAULT_HELDOUT = (
    "The river follows the morning train for the first time. A quiet town remembers the secret map "
    "at the end of the week. Every sailor finds a golden key without a sound.",
    "My neighbour paints a red kite in the afternoon. The compiler measures seven bright stones near "
    "the harbour, and the teacher answers the final answer with great care.",
)


# The figures of a check that did not run stay out of the artifact's metadata (flag → its figures).
_CHECKS = {
    "tokens_checked": ("tokens_match", "token_mismatches"),
    "chat_tokens_checked": ("chat_tokens_match",),
    "answer_checked": ("answer_reproduced", "answer_top1_agreement"),
}


def verification_metadata(v: Verification) -> dict[str, str]:
    """``v`` as flat ``verify.*`` strings for artifact metadata (lists joined with "; ").

    The ``*_checked`` flags are not stored: a check that ran is one whose figures are present.
    """
    skip = set(_CHECKS)
    for flag, figures in _CHECKS.items():
        if not getattr(v, flag):
            skip.update(figures)
    flat: dict[str, object] = {}
    for k, value in to_dict(v).items():
        if isinstance(value, dict):  # the as-trained comparison: verify.as_trained.*
            flat.update({f"{k}.{kk}": vv for kk, vv in value.items()})
        elif k not in skip:
            flat[k] = value
    out = {}
    for k, value in flat.items():
        if value is None or value == [] or value == "":
            continue
        out[f"verify.{k}"] = "; ".join(map(str, value)) if isinstance(value, list) else str(value)
    return out


LogitsFn = Callable[[list[int]], np.ndarray]


@dataclass
class Probe:
    """The tokenized material and the reference's logits on it, shared by every output of an export."""

    prompt_texts: list[str]
    heldout_texts: list[str]
    prompts: list[list[int]]
    heldout: list[list[int]]
    eos_ids: set[int]
    qa_prompt_text: str = ""
    qa_prompt: list[int] = field(default_factory=list)
    qa_answer: list[int] = field(default_factory=list)
    answer_text: str = ""
    max_new_tokens: int = 0
    ref_prompts: list[np.ndarray] = field(default_factory=list)
    ref_heldout: list[np.ndarray] = field(default_factory=list)
    ref_qa: np.ndarray | None = None
    ref_generated: str = ""
    tokenizer: Any = None
    sliding_window: int | None = None  # the model's attention window, when some layer has one
    trained_label: str = ""  # the as-trained reference, in words ("" until it is filled)
    trained_prompts: list[np.ndarray] = field(default_factory=list)
    trained_heldout: list[np.ndarray] = field(default_factory=list)
    trained_qa: np.ndarray | None = None

    @property
    def has_qa(self) -> bool:
        return bool(self.qa_answer)


def _load_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)


def sliding_window_of(config: dict[str, Any]) -> int | None:
    """The attention window of ``config``'s sliding layers, or None when every layer attends fully."""
    arch = arch_of(str(config.get("model_type")))
    window = config.get("sliding_window")
    if arch is None or not isinstance(window, int) or window <= 0:
        return None
    if arch.sliding_window is SlidingWindow.CONFIG:
        return window
    if arch.sliding_window is SlidingWindow.LAYER and "sliding_attention" in (
        config.get("layer_types") or []
    ):
        return window
    return None


def build_probe(
    options: VerifyOptions, tok_dir: Path, generation_eos: Sequence[int], *, sliding_window: int | None = None
) -> Probe:
    """Tokenize the prompt set, held-out text and the probe question/answer with the HF tokenizer.

    ``sliding_window``: the model's (:func:`sliding_window_of`); a comparison whose prompts all fit in it
    says so in its notes, since sliding layers then compute what full attention would.
    """
    tok = _load_tokenizer(tok_dir)
    prompts = list(options.prompts or DEFAULT_PROMPTS)
    heldout = list(options.heldout_texts or DEFAULT_HELDOUT)
    eos = {int(x) for x in generation_eos}
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    p = Probe(
        prompt_texts=prompts,
        heldout_texts=heldout,
        prompts=[tok(t)["input_ids"] for t in prompts],
        heldout=[tok(t)["input_ids"] for t in heldout],
        eos_ids=eos,
        tokenizer=tok,
        sliding_window=sliding_window,
    )
    if options.has_probe:
        question, answer = options.question, options.answer
        if not options.raw_question and tok.chat_template:
            q = tok.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        else:
            q = question
        q_ids = tok(q)["input_ids"]
        full = tok(q + answer)["input_ids"]
        if full[: len(q_ids)] == q_ids:
            a_ids = full[len(q_ids) :]
        else:
            a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        p.qa_prompt_text, p.qa_prompt, p.qa_answer, p.answer_text = q, q_ids, a_ids, answer
        p.max_new_tokens = options.max_new_tokens or len(a_ids) + 8
    return p


def reference_model(
    base: BaseModel, adapter: Adapter | None, before_tensor: Callable[[str], None] | None = None
):
    """The merged model in fp32, assembled in memory with transformers (no cast anywhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in base.config.items() if k not in ("quantization_config", "transformers_version")}
    config = AutoConfig.for_model(**cfg)
    with hf_build.building():  # export jobs verify on a thread pool (common/hf_build)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # a per-expert MoE checkpoint's tensors stacked into the model's fused expert parameters
    state = moe.model_state(base.config, dict(iter_merged(base, adapter, before_tensor=before_tensor)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConsumerRejected(f"reference model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def as_trained_label(trained_base: BaseModel, adapter: Adapter | None) -> str:
    """The model as trained, in words (the ``reference`` of ``Verification.as_trained``)."""
    if trained_base.on_load is not None:
        weights = (
            f"{trained_base.dtype} base quantized on load as the trainer did "
            f"({trained_base.on_load.describe()}), dequantized to float32"
        )
    elif trained_base.quantization != "none":
        weights = f"{trained_base.quantization} base dequantized to float32"
    else:
        weights = f"{trained_base.dtype} base as stored"
    return weights + (" + the adapter unmerged (PEFT), float32" if adapter is not None else ", float32")


def as_trained_model(
    trained_base: BaseModel, adapter: Adapter | None, before_tensor: Callable[[str], None] | None = None
):
    """The model as trained, in fp32: the base as the trainer loaded it with the adapter applied unmerged
    by PEFT (``x·Wᵀ + s·(x·Aᵀ)·Bᵀ``: the function training optimised, computed another way than the merge)."""
    model = reference_model(trained_base, None, before_tensor=before_tensor)
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter.path), is_trainable=False).eval()


def fill_as_trained(probe: Probe, model, label: str) -> None:
    """Run the as-trained model on the probe."""
    fn = hf_logits_fn(model)
    probe.trained_prompts = [fn(ids) for ids in probe.prompts]
    probe.trained_heldout = [fn(ids) for ids in probe.heldout]
    if probe.has_qa:
        probe.trained_qa = fn(probe.qa_prompt + probe.qa_answer)
    probe.trained_label = label


def hf_logits_fn(model) -> LogitsFn:
    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].to(torch.float32).numpy()

    return run


def greedy(logits_fn: LogitsFn, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy decoding by recomputing the whole sequence (fine for the short probes used here)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(np.argmax(logits_fn(ids)[-1]))
        if nxt in eos:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def fill_reference(probe: Probe, model) -> None:
    """Run the reference on the probe (its logits, its own greedy answer)."""
    fn = hf_logits_fn(model)
    probe.ref_prompts = [fn(ids) for ids in probe.prompts]
    probe.ref_heldout = [fn(ids) for ids in probe.heldout]
    if probe.has_qa:
        probe.ref_qa = fn(probe.qa_prompt + probe.qa_answer)
        gen = greedy(fn, probe.qa_prompt, probe.max_new_tokens, probe.eos_ids)
        probe.ref_generated = probe.tokenizer.decode(gen, skip_special_tokens=True)


def _nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    x = torch.from_numpy(logits[:-1]).to(torch.float64)
    lp = torch.log_softmax(x, dim=-1)
    tgt = torch.tensor(ids[1:])
    return float(-lp.gather(1, tgt.unsqueeze(1)).sum()), len(ids) - 1


def _ppl(logits: list[np.ndarray], seqs: list[list[int]]) -> float:
    total, n = 0.0, 0
    for lg, ids in zip(logits, seqs, strict=True):
        s, k = _nll(lg, ids)
        total, n = total + s, n + k
    return math.exp(total / max(n, 1))


# A 2–6 bit quantization passes when its teacher-forced top-1 on the trained answer keeps this share.
LOSSY_ANSWER_TOP1 = 0.95


def reproduces(generated: str, answer: str) -> bool:
    return generated.strip().startswith(answer.strip())


def compare(
    probe: Probe,
    consumer: str,
    logits_fn: LogitsFn,
    *,
    generate: Callable[[list[int], int, set[int]], list[int]] | None = None,
    tokenize: Callable[[str], list[int]] | None = None,
    lossy: bool = False,
) -> Verification:
    """Figures of one output (given as a logits function) against the reference in ``probe``.

    Args:
        generate: greedy decoding in the consumer (default: recompute with ``logits_fn``).
        tokenize: the consumer's own tokenizer (llama.cpp), checked against HF's ids.
        lossy: a 2–6 bit quantization: judged on teacher-forced answer agreement, not on generation.
    """
    v = Verification(consumer=consumer)
    outs = [logits_fn(ids) for ids in probe.prompts]
    deltas = np.concatenate([np.abs(o - r).reshape(-1) for o, r in zip(outs, probe.ref_prompts, strict=True)])
    agree = np.concatenate(
        [o.argmax(-1) == r.argmax(-1) for o, r in zip(outs, probe.ref_prompts, strict=True)]
    )
    v.positions = int(agree.size)
    longest = max(len(ids) for ids in probe.prompts)
    if probe.sliding_window is not None and longest <= probe.sliding_window:
        v.notes.append(
            f"sliding-window layers were compared within their window only ({probe.sliding_window} tokens; the "
            f"longest prompt has {longest}): give longer prompts to compare them past it"
        )
    v.max_abs_logit_delta = float(deltas.max())
    v.mean_abs_logit_delta = float(deltas.mean())
    v.top1_agreement = float(agree.mean())
    held = [logits_fn(ids) for ids in probe.heldout]
    v.perplexity_reference = _ppl(probe.ref_heldout, probe.heldout)
    v.perplexity = _ppl(held, probe.heldout)
    v.perplexity_delta = v.perplexity - v.perplexity_reference
    qa_logits = logits_fn(probe.qa_prompt + probe.qa_answer) if probe.has_qa else None
    if probe.trained_label:
        v.as_trained = _compare_as_trained(probe, outs, held, qa_logits)
    if tokenize is not None:
        for text, ids in zip(
            probe.prompt_texts + probe.heldout_texts, probe.prompts + probe.heldout, strict=True
        ):
            if tokenize(text) != ids:
                v.token_mismatches.append(text[:40])
        v.tokens_checked, v.tokens_match = True, not v.token_mismatches
        if probe.has_qa:
            v.chat_tokens_checked = True
            v.chat_tokens_match = tokenize(probe.qa_prompt_text) == probe.qa_prompt
            if not v.chat_tokens_match:
                v.notes.append(
                    "llama.cpp tokenizes the chat-formatted question differently from HF "
                    "(SentencePiece: llama.cpp prefixes a space after special tokens); ids were fed directly"
                )
    if probe.has_qa:
        assert probe.ref_qa is not None
        full = probe.qa_prompt + probe.qa_answer
        lg = qa_logits
        assert lg is not None
        n = len(probe.qa_prompt)
        pred = lg[n - 1 : len(full) - 1].argmax(-1)
        v.answer_checked = True
        v.answer_tokens = len(probe.qa_answer)
        v.answer_top1_agreement = float((pred == np.array(probe.qa_answer)).mean())
        gen = (generate or (lambda p, m, e: greedy(logits_fn, p, m, e)))(
            probe.qa_prompt, probe.max_new_tokens, probe.eos_ids
        )
        v.generated = probe.tokenizer.decode(gen, skip_special_tokens=True)
        v.answer_reproduced = reproduces(v.generated, probe.answer_text)
        if lossy and v.answer_top1_agreement < LOSSY_ANSWER_TOP1:
            v.problems.append(
                f"teacher-forced top-1 agreement on the trained answer is {v.answer_top1_agreement:.3f} "
                f"({v.answer_tokens} tokens), below the {LOSSY_ANSWER_TOP1} a lossy quantization must keep; "
                f"greedy generation gave {v.generated!r}"
            )
        elif not lossy and not v.answer_reproduced:
            v.problems.append(
                f"greedy generation does not reproduce the trained answer: {v.generated!r} instead of "
                f"{probe.answer_text!r} (teacher-forced top-1 agreement {v.answer_top1_agreement:.3f})"
            )
    if not (math.isfinite(v.max_abs_logit_delta) and math.isfinite(v.perplexity)):
        v.problems.insert(
            0, f"non-finite figures: max |dlogit| {v.max_abs_logit_delta}, perplexity {v.perplexity}"
        )
    if v.tokens_checked and not v.tokens_match:
        v.problems.append(
            f"llama.cpp tokenizes {len(v.token_mismatches)} text(s) differently from transformers: "
            f"{v.token_mismatches[:3]}"
        )
    # every reason to fail is a problem with its figures: passed is exactly "no problems"
    v.passed = not v.problems
    return v


def _compare_as_trained(
    probe: Probe, outs: list[np.ndarray], held: list[np.ndarray], qa_logits: np.ndarray | None
) -> Comparison:
    """The output's logits (those of the merged-model figures) against the model as trained.

    ``answer_top1_agreement`` here: teacher-forced on the answer's positions, the output's top-1 equals
    the as-trained model's.
    """
    c = Comparison(reference=probe.trained_label)
    pairs = list(zip(outs, probe.trained_prompts, strict=True))
    deltas = np.concatenate([np.abs(o - r).reshape(-1) for o, r in pairs])
    c.max_abs_logit_delta = float(deltas.max())
    c.mean_abs_logit_delta = float(deltas.mean())
    c.max_abs_logit = float(max(np.abs(r).max() for r in probe.trained_prompts))
    c.top1_agreement = float(np.concatenate([o.argmax(-1) == r.argmax(-1) for o, r in pairs]).mean())
    c.perplexity_reference = _ppl(probe.trained_heldout, probe.heldout)
    c.perplexity_delta = _ppl(held, probe.heldout) - c.perplexity_reference
    if qa_logits is not None and probe.trained_qa is not None:
        n, end = len(probe.qa_prompt), len(probe.qa_prompt) + len(probe.qa_answer)
        mine, theirs = qa_logits[n - 1 : end - 1].argmax(-1), probe.trained_qa[n - 1 : end - 1].argmax(-1)
        c.answer_top1_agreement = float((mine == theirs).mean())
    return c


class LlamaCpp:
    """A llama.cpp model (optionally with a LoRA adapter) via llama-cpp-python, as a logits function."""

    def __init__(self, model_path: Path, *, lora_path: Path | None = None, n_ctx: int = 512):
        from llama_cpp import Llama

        try:
            self.llm = Llama(
                str(model_path),
                lora_path=str(lora_path) if lora_path else None,
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                logits_all=True,
                n_threads=os.cpu_count() or 1,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise ConsumerRejected(f"llama.cpp could not load {model_path.name}: {exc}") from None

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def generate(self, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out: list[int] = []
        for _ in range(max_new):
            nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            if nxt in eos or self.llm.token_eos() == nxt:
                break
            out.append(nxt)
            self.llm.eval([nxt])
        return out

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def close(self) -> None:
        self.llm.close()
        gc.collect()


def n_ctx_for(probe: Probe) -> int:
    longest = max(len(s) for s in [*probe.prompts, *probe.heldout, probe.qa_prompt + probe.qa_answer])
    return max(64, longest + probe.max_new_tokens + 8)


def verify_gguf(
    probe: Probe, model_path: Path, *, lora_path: Path | None = None, lossy: bool = False
) -> Verification:
    """Load a GGUF (plus LoRA) in llama.cpp and compare it with the reference."""
    lc = LlamaCpp(model_path, lora_path=lora_path, n_ctx=n_ctx_for(probe))
    try:
        return compare(
            probe,
            "llama.cpp+lora" if lora_path else "llama.cpp",
            lc.logits,
            generate=lc.generate,
            tokenize=lc.tokenize,
            lossy=lossy,
        )
    finally:
        lc.close()


def verify_hf_dir(probe: Probe, model_dir: Path) -> Verification:
    """Load a merged directory with transformers (weights upcast to fp32) and compare."""
    from transformers import AutoModelForCausalLM

    with hf_build.building():
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, trust_remote_code=False
        )
    try:
        return compare(probe, "transformers", hf_logits_fn(model.eval()))
    finally:
        del model
        gc.collect()


def verify_peft_dir(
    probe: Probe, base_dir: Path, adapter_dir: Path, *, trained_base: BaseModel | None = None
) -> Verification:
    """Load the base with transformers (4-bit through bitsandbytes), apply the PEFT dir, compare.

    ``trained_base`` with an ``on_load`` quantization: the base is loaded as the trainer held it (its
    Linear4bit weights replaced by their NF4 codes dequantized to fp32), the way an adapter trained on
    an NF4 base is meant to be served.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    on_16bit = None
    if trained_base is not None and trained_base.on_load is not None and probe.trained_label:
        on_16bit = peft_on_16bit_base(probe, base_dir, adapter_dir)
    with hf_build.building():
        base = AutoModelForCausalLM.from_pretrained(
            str(base_dir), dtype=torch.float32, trust_remote_code=False
        )
    if trained_base is not None and trained_base.on_load is not None:
        nf4 = {n: trained_base.read_fp32(n) for n in trained_base.tensors if trained_base.is_dequantized(n)}
        missing = set(nf4) - set(base.state_dict())
        if missing:
            raise ConsumerRejected(f"the base loaded by transformers lacks {sorted(missing)[:3]}")
        base.load_state_dict(nf4, strict=False)
        del nf4
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    try:
        v = compare(probe, "transformers+peft", hf_logits_fn(model))
    finally:
        del model, base
        gc.collect()
    v.on_16bit_base = on_16bit
    return v


def peft_on_16bit_base(probe: Probe, base_dir: Path, adapter_dir: Path) -> Comparison:
    """A PEFT dir served as vLLM's ``--enable-lora`` (or ``PeftModel`` on the checkpoint) serves it: on the base's
    16-bit weights as stored (upcast to fp32), compared with the model as trained. For an adapter trained on the
    base's NF4 quantization this is another model, and the figures say how far."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with hf_build.building():
        base = AutoModelForCausalLM.from_pretrained(
            str(base_dir), dtype=torch.float32, trust_remote_code=False
        )
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    try:
        fn = hf_logits_fn(model)
        outs = [fn(ids) for ids in probe.prompts]
        held = [fn(ids) for ids in probe.heldout]
        qa = fn(probe.qa_prompt + probe.qa_answer) if probe.has_qa else None
        return _compare_as_trained(probe, outs, held, qa)
    finally:
        del model, base
        gc.collect()
