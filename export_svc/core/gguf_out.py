"""GGUF files for llama.cpp, written with the ``gguf`` package: models (F32/F16/BF16/Q8_0) and LoRA adapters.

What llama.cpp reads, and where each piece comes from:

- architecture metadata (``<arch>.block_count``, ``context_length``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count[_kv]``, ``attention.layer_norm_rms_epsilon``,
  ``attention.key_length/value_length``, ``rope.freq_base``, ``rope.dimension_count``, rope scaling)
  from ``config.json``; ``general.architecture`` is ``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``;
- tensor names from gguf-py's ``TensorNameMap`` (``blk.N.attn_q.weight`` …); q/k weights and biases of
  the ``llama`` arch permuted from HF's rotate-half rows to llama.cpp's interleaved pairs;
- the tokenizer: byte-level BPE as ``tokenizer.ggml.model=gpt2`` with merges and
  ``tokenizer.ggml.pre`` naming the pre-tokenizer (GPT-2's regex is ``gpt-2``; Llama 3's ``llama-bpe``;
  Qwen2's ``qwen2``), or SentencePiece as ``llama`` with scores and token types; special token ids,
  ``add_bos_token``/``add_eos_token``, ``add_space_prefix`` and the chat template.

Writing streams: the tensor plan (names, shapes, types, byte sizes) is fixed first, the header,
metadata and tensor infos are written, then tensors are merged, converted and written one at a time.
``GgufStreamWriter`` is the explicit state machine over gguf-py's writer.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from strop.export_svc.core.archs import ArchInfo, head_dim, permute_qk
from strop.export_svc.core.errors import (
    CorruptInput,
    TargetRefused,
    UnknownFormat,
    UnsupportedModel,
    WriterStateError,
)
from strop.export_svc.core.hf_dir import chat_template_of
from strop.export_svc.core.merge import iter_merged
from strop.export_svc.core.sources import Adapter, BaseModel, read_json

QT = gguf.GGMLQuantizationType
# GGUF model types the gguf package writes directly: name → (tensor type for 2-D weights, general.file_type)
DIRECT_TYPES: dict[str, tuple[QT, int]] = {
    "F32": (QT.F32, int(gguf.LlamaFileType.ALL_F32)),
    "F16": (QT.F16, int(gguf.LlamaFileType.MOSTLY_F16)),
    "BF16": (QT.BF16, int(gguf.LlamaFileType.MOSTLY_BF16)),
    "Q8_0": (QT.Q8_0, int(gguf.LlamaFileType.MOSTLY_Q8_0)),
}
LORA_TYPES: dict[str, QT] = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16}
_GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}

# Pre-tokenizer regexes (tokenizer.json `Split` patterns) → llama.cpp's `tokenizer.ggml.pre` names.
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_PRE = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


# ---------------------------------------------------------------------------------------------
# Tokenizer metadata


@dataclass
class GgufVocab:
    """Everything GGUF stores about a tokenizer."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, sep → id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def add_to(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        for role, tid in self.special.items():
            getattr(w, f"add_{role}_token_id")(tid)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<s>", "</s>", "<unk>", "<pad>")


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def detect_pre_tokenizer(tj: dict[str, Any]) -> str:
    """llama.cpp's name for a byte-level BPE's pre-tokenizer, read from tokenizer.json.

    Raises:
        UnsupportedModel: a pre-tokenizer strop cannot name for llama.cpp.
    """
    pt = tj.get("pre_tokenizer") or {}
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True) and not pt.get("add_prefix_space", False):
        return "gpt-2"
    if pt.get("type") == "Sequence":
        items = pt.get("pretokenizers") or []
        splits = [p for p in items if p.get("type") == "Split"]
        byte_level = [p for p in items if p.get("type") == "ByteLevel"]
        if len(splits) == 1 and len(byte_level) == 1 and not byte_level[0].get("use_regex", True):
            regex = (splits[0].get("pattern") or {}).get("Regex")
            if regex in _SPLIT_PRE:
                return _SPLIT_PRE[regex]
    summary = json.dumps(pt)[:200]
    raise UnsupportedModel(
        f"tokenizer pre-tokenizer {summary} has no llama.cpp name strop knows (known: gpt-2, llama-bpe, qwen2)"
    )


def _special_ids(
    tok_dir: Path, lookup: Callable[[str], int | None], config: dict[str, Any]
) -> dict[str, int]:
    tc = (
        read_json(tok_dir / "tokenizer_config.json", "tokenizer_config.json")
        if (tok_dir / "tokenizer_config.json").is_file()
        else {}
    )
    stm = (
        read_json(tok_dir / "special_tokens_map.json", "special_tokens_map.json")
        if (tok_dir / "special_tokens_map.json").is_file()
        else {}
    )
    out = {}
    for role in ("bos", "eos", "unk", "pad", "sep"):
        text = _token_str(tc.get(f"{role}_token")) or _token_str(stm.get(f"{role}_token"))
        tid = lookup(text) if text else None
        if tid is None:
            v = config.get(f"{role}_token_id")
            tid = v[0] if isinstance(v, list) and v else v
        if isinstance(tid, int) and tid >= 0:
            out[role] = tid
    return out


def _post_processor_adds(tj: dict[str, Any], tc: dict[str, Any]) -> tuple[bool, bool]:
    """(add_bos, add_eos) as the HF tokenizer applies them."""
    pp = tj.get("post_processor") or {}
    single = []
    if pp.get("type") == "TemplateProcessing":
        single = pp.get("single") or []
    elif pp.get("type") == "Sequence":
        for p in pp.get("processors") or []:
            if p.get("type") == "TemplateProcessing":
                single = p.get("single") or []
    add_bos = bool(single) and "SpecialToken" in single[0]
    add_eos = bool(single) and "SpecialToken" in single[-1] and len(single) > 1
    if isinstance(tc.get("add_bos_token"), bool) and not single:
        add_bos = tc["add_bos_token"]
    if isinstance(tc.get("add_eos_token"), bool) and not single:
        add_eos = tc["add_eos_token"]
    return add_bos, add_eos


def _runtime_tokenizer_json(tok_dir: Path) -> dict[str, Any]:
    """The tokenizer as transformers actually runs it, serialized like tokenizer.json.

    Not the file as saved: transformers 5 picks the tokenizer class from the model type and some
    classes rebuild parts of the pipeline (its Qwen2 tokenizer applies Qwen2's digit-splitting regex
    whatever tokenizer.json says). llama.cpp must be told what HF does at run time.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return json.loads(backend.to_str())
    except (OSError, ValueError) as exc:
        raise CorruptInput(f"transformers cannot load the tokenizer: {exc}") from None
    if (tok_dir / "tokenizer.json").is_file():
        return read_json(tok_dir / "tokenizer.json", "tokenizer.json")
    return {}


def load_vocab(tok_dir: Path, config: dict[str, Any]) -> GgufVocab:
    """Read a HF tokenizer directory into GGUF tokenizer metadata, padded to the model's vocab size.

    Raises:
        UnsupportedModel: a tokenizer kind or pre-tokenizer llama.cpp cannot be told about.
        CorruptInput: the tokenizer has more tokens than the model's embedding rows.
    """
    vocab_size = int(config["vocab_size"])
    tj = _runtime_tokenizer_json(tok_dir)
    tc = (
        read_json(tok_dir / "tokenizer_config.json", "tokenizer_config.json")
        if (tok_dir / "tokenizer_config.json").is_file()
        else {}
    )
    added = {int(t["id"]): t for t in tj.get("added_tokens") or []}
    for tid, t in (tc.get("added_tokens_decoder") or {}).items():
        added.setdefault(int(tid), t)
    if (tok_dir / "tokenizer.model").is_file():
        v = _spm_vocab(tok_dir / "tokenizer.model", added, vocab_size)
    elif (tj.get("model") or {}).get("type") == "BPE":
        v = _bpe_vocab(tj, added, vocab_size)
    else:
        kind = (tj.get("model") or {}).get("type")
        raise UnsupportedModel(
            f"tokenizer model {kind!r} cannot be written to GGUF (BPE or SentencePiece only)"
        )
    index = {t: i for i, t in enumerate(v.tokens)}
    v.special = _special_ids(tok_dir, index.get, config)
    v.add_bos, v.add_eos = _post_processor_adds(tj, tc)
    v.chat_template = chat_template_of(tok_dir)
    return v


def _pad(tokens: list[str], types: list[int], scores: list[float] | None, vocab_size: int, what: str) -> None:
    if len(tokens) > vocab_size:
        raise CorruptInput(
            f"the {what} tokenizer has {len(tokens)} tokens but the model only {vocab_size} embedding rows"
        )
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)


def _bpe_vocab(tj: dict[str, Any], added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    pre = detect_pre_tokenizer(tj)
    model = tj["model"]
    id_to_tok: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    for i, t in added.items():
        id_to_tok[i] = t["content"]
    n = max(id_to_tok) + 1
    tokens, types = [], []
    for i in range(n):
        t = id_to_tok.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(t)
            special = added[i].get("special", False) or _looks_special(t)
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(t)
            types.append(int(gguf.TokenType.NORMAL))
    _pad(tokens, types, None, vocab_size, "BPE")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return GgufVocab("gpt2", pre, tokens, types, merges=merges, add_space_prefix=False)


def _spm_vocab(path: Path, added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise CorruptInput(f"tokenizer.model is not a SentencePiece model: {exc}") from None
    if proto.trainer_spec.model_type not in (1, 2):  # UNIGRAM=1, BPE=2
        raise UnsupportedModel(f"SentencePiece model type {proto.trainer_spec.model_type} is not supported")
    tokens = [p.piece for p in proto.pieces]
    scores = [float(p.score) for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]  # sentencepiece's type numbers are gguf's TokenType
    for i, t in added.items():
        while i >= len(tokens):
            tokens.append(f"[PAD{len(tokens)}]")
            scores.append(-1000.0)
            types.append(int(gguf.TokenType.UNUSED))
        text = t["content"]
        if types[i] in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.BYTE)):
            continue  # <s>, </s>, <unk>, <0x..>: SentencePiece already typed them
        special = t.get("special", False) or _looks_special(text)
        tokens[i] = text
        scores[i] = -1000.0
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    _pad(tokens, types, scores, vocab_size, "SentencePiece")
    return GgufVocab(
        "llama",
        "default",
        tokens,
        types,
        scores=scores,
        add_space_prefix=bool(proto.normalizer_spec.add_dummy_prefix),
    )


# ---------------------------------------------------------------------------------------------
# Architecture metadata


def rope_of(config: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(theta, rope_type, parameters) from transformers 5's ``rope_parameters`` or 4's ``rope_scaling``."""
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        return (
            float(rp.get("rope_theta", config.get("rope_theta", 10000.0))),
            str(rp.get("rope_type", "default")),
            rp,
        )
    rs = config.get("rope_scaling") or {}
    return float(config.get("rope_theta", 10000.0)), str(rs.get("rope_type", rs.get("type", "default"))), rs


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """Llama 3.1-style frequency scaling as llama.cpp's ``rope_freqs`` tensor (one factor per pair)."""
    theta, _, p = rope_of(config)
    dim = head_dim(config)
    factor = float(p.get("factor", 8.0))
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    out = []
    for k in range(0, dim, 2):
        freq = 1.0 / theta ** (k / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def add_model_metadata(w: gguf.GGUFWriter, config: dict[str, Any], arch: ArchInfo, name: str) -> None:
    """General and architecture keys (everything but the tokenizer and file type)."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_context_length(int(config.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(int(config["num_attention_heads"]))
    w.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    theta, rope_type, p = rope_of(config)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim(config))
    if config.get("head_dim"):
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))
    if arch.gguf_arch == "llama":
        w.add_vocab_size(int(config["vocab_size"]))
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(p["factor"]))
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(p["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(p["original_max_position_embeddings"]))
    elif rope_type not in ("default", "llama3"):
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported for GGUF export")


# ---------------------------------------------------------------------------------------------
# The streaming writer


class GgufState(enum.Enum):
    """States of ``GgufStreamWriter``."""

    PLANNING = "planning"  # metadata and tensor infos being added
    WRITING = "writing"  # header, metadata and tensor infos on disk; tensor data streaming
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class GgufTensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), as HF stores it
    qtype: QT

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.qtype)


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * type_size


class GgufStreamWriter:
    """gguf-py's writer driven as an explicit state machine, tensors streamed one by one.

    ``kv`` (the gguf-py writer) takes metadata while PLANNING; ``plan`` adds tensor infos; ``begin``
    writes header + metadata + tensor infos; ``write`` takes tensors in plan order; ``finish`` closes
    and fsyncs. Calls out of order raise WriterStateError("expected X, got Y").
    """

    def __init__(self, path: Path, arch: str):
        self.path = Path(path)
        self.kv = gguf.GGUFWriter(None, arch)
        self.state = GgufState.PLANNING
        self.planned: list[GgufTensorPlan] = []
        self._next = 0
        self.bytes_written = 0

    def _expect(self, state: GgufState) -> None:
        if self.state is not state:
            raise WriterStateError(f"expected GGUF writer state {state.value}, got {self.state.value}")

    @property
    def bytes_total(self) -> int:
        return sum(_nbytes(p.shape, p.qtype) for p in self.planned)

    def plan(self, name: str, shape: tuple[int, ...], qtype: QT) -> None:
        self._expect(GgufState.PLANNING)
        p = GgufTensorPlan(name, tuple(shape), qtype)
        nbytes = _nbytes(p.shape, qtype)
        if qtype in (QT.F32, QT.F16):
            self.kv.add_tensor_info(
                name, p.shape, np.dtype(np.float32 if qtype == QT.F32 else np.float16), nbytes
            )
        elif qtype == QT.BF16:
            self.kv.add_tensor_info(name, p.shape, np.dtype(np.int16), nbytes, raw_dtype=QT.BF16)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(p.shape, qtype)
            self.kv.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        self.planned.append(p)

    def begin(self) -> None:
        self._expect(GgufState.PLANNING)
        if not self.planned:
            raise WriterStateError("expected at least one planned tensor, got none")
        self.kv.write_header_to_file(self.path)
        self.kv.write_kv_data_to_file()
        self.kv.write_ti_data_to_file()
        self.state = GgufState.WRITING

    def write(self, name: str, data: np.ndarray) -> int:
        self._expect(GgufState.WRITING)
        if self._next >= len(self.planned):
            raise WriterStateError(f"expected no more tensors (plan complete), got {name!r}")
        p = self.planned[self._next]
        if name != p.name:
            raise WriterStateError(f"expected tensor {p.name!r} next, got {name!r}")
        nbytes = _nbytes(p.shape, p.qtype)
        if data.nbytes != nbytes:
            raise WriterStateError(
                f"expected {nbytes} bytes for {name!r} ({p.qtype.name}), got {data.nbytes}"
            )
        self.kv.write_tensor_data(np.ascontiguousarray(data))
        self._next += 1
        self.bytes_written += nbytes
        return nbytes

    def finish(self) -> None:
        self._expect(GgufState.WRITING)
        if self._next != len(self.planned):
            raise WriterStateError(
                f"expected tensor {self.planned[self._next].name!r} before finishing, got finish()"
            )
        assert self.kv.fout is not None
        for f in self.kv.fout:
            f.flush()
            os.fsync(f.fileno())
        self.kv.close()
        self.state = GgufState.FINISHED

    def abort(self) -> None:
        self.kv.close()
        self.state = GgufState.FAILED


def encode(t: torch.Tensor, qtype: QT) -> np.ndarray:
    """A tensor (fp32, or a 16-bit one as stored) as the bytes of ``qtype``, in one cast.

    Casting a bf16/fp16 tensor directly equals casting it through fp32 (the upcast is exact).
    """
    if qtype == QT.F32:
        return t.to(torch.float32).contiguous().numpy()
    if qtype == QT.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == QT.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return gguf.quants.quantize(t.to(torch.float32).contiguous().numpy(), qtype)


def tensor_type(gname: str, shape: tuple[int, ...], model_type: QT) -> QT:
    """Norms, biases and other 1-D tensors stay F32; Q8_0 needs rows that are multiples of 32 (else F16)."""
    if len(shape) < 2 or gname.endswith("_norm.weight") or model_type == QT.F32:
        return QT.F32
    if model_type == QT.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return model_type


def gguf_tensor_name(name_map: gguf.TensorNameMap, hf_name: str) -> str:
    g = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if g is None:
        raise UnsupportedModel(f"tensor {hf_name!r} has no llama.cpp name")
    return g


def _qk_heads(base: BaseModel, hf_name: str) -> int | None:
    if not base.arch.permute_qk:
        return None
    if ".self_attn.q_proj." in hf_name:
        return int(base.config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return int(base.config.get("num_key_value_heads") or base.config["num_attention_heads"])
    return None


def write_gguf_model(
    path: Path,
    base: BaseModel,
    adapter: Adapter | None,
    vocab: GgufVocab,
    *,
    gguf_type: str,
    name: str,
    before_tensor: Callable[[str], None] | None = None,
    after_tensor: Callable[[str, int, int, int], None] | None = None,
) -> int:
    """Merge (if ``adapter``) and write one GGUF model file of ``gguf_type``; returns its size in bytes.

    Raises:
        UnknownFormat: ``gguf_type`` is not one of F32, F16, BF16, Q8_0.
    """
    if gguf_type not in DIRECT_TYPES:
        raise UnknownFormat(
            f"GGUF type {gguf_type!r} is not written directly; choose from {sorted(DIRECT_TYPES)}"
        )
    model_type, file_type = DIRECT_TYPES[gguf_type]
    arch = base.arch
    name_map = gguf.get_tensor_name_map(_GGUF_ARCH[arch.gguf_arch], base.num_layers)
    w = GgufStreamWriter(path, arch.gguf_arch)
    try:
        add_model_metadata(w.kv, base.config, arch, name)
        w.kv.add_file_type(file_type)
        if model_type not in (QT.F32, QT.F16, QT.BF16):
            w.kv.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.add_to(w.kv)
        _, rope_type, _ = rope_of(base.config)
        extra: list[tuple[str, np.ndarray]] = []
        if rope_type == "llama3":
            extra.append(
                (
                    gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                    llama3_rope_factors(base.config),
                )
            )
        for gname, arr in extra:
            w.plan(gname, arr.shape, QT.F32)
        names = [n for n in base.tensors if "rotary_emb.inv_freq" not in n]
        gnames = {n: gguf_tensor_name(name_map, n) for n in names}
        for n in names:
            shape = base.tensors[n].shape
            w.plan(gnames[n], shape, tensor_type(gnames[n], shape, model_type))
        w.begin()
        for gname, arr in extra:
            w.write(gname, arr)
        for i, (n, t) in enumerate(iter_merged(base, adapter, names=names, before_tensor=before_tensor)):
            heads = _qk_heads(base, n)
            if heads is not None:
                t = permute_qk(t, heads)
            w.write(gnames[n], encode(t, w.planned[len(extra) + i].qtype))
            if after_tensor is not None:
                after_tensor(n, i, w.bytes_written, w.bytes_total)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return path.stat().st_size


def lora_alpha_for_gguf(adapter: Adapter) -> tuple[float, bool]:
    """(alpha to store, fold scale into B?). llama.cpp scales each pair by ``alpha / rank``.

    When every module shares one ``scale·r`` (always, unless rank/alpha patterns differ), storing
    ``alpha = scale·r`` reproduces PEFT's scale exactly, rsLoRA included. Otherwise alpha is stored
    as 0 (llama.cpp then applies no scale) and each module's scale is folded into its B.
    """
    products = {round(m.scale * m.r, 9) for m in adapter.modules.values()}
    if len(products) == 1:
        return float(products.pop()), False
    return 0.0, True


def write_gguf_lora(
    path: Path,
    base: BaseModel,
    adapter: Adapter,
    *,
    lora_type: str = "F32",
    name: str,
    before_tensor: Callable[[str], None] | None = None,
    after_tensor: Callable[[str, int, int, int], None] | None = None,
) -> int:
    """Write a GGUF LoRA adapter llama.cpp applies to the GGUF of ``base``; returns its size.

    Raises:
        TargetRefused: DoRA, embedding LoRA, or whole-module replacements (llama.cpp's LoRA cannot
            express them; export a merged GGUF instead).
        UnknownFormat: ``lora_type`` not F32/F16/BF16.
    """
    if lora_type not in LORA_TYPES:
        raise UnknownFormat(f"GGUF LoRA tensor type {lora_type!r} is not one of {sorted(LORA_TYPES)}")
    why = []
    if adapter.use_dora:
        why.append("DoRA")
    if any(m.kind == "embedding" for m in adapter.modules.values()):
        why.append("LoRA on embeddings")
    if adapter.replacements:
        why.append(f"whole-module weights ({sorted(adapter.replacements)[:2]})")
    if why:
        raise TargetRefused(
            f"adapter {adapter.label!r} uses {', '.join(why)}, which a GGUF LoRA cannot carry; export a merged GGUF"
        )
    qtype = LORA_TYPES[lora_type]
    name_map = gguf.get_tensor_name_map(_GGUF_ARCH[base.arch.gguf_arch], base.num_layers)
    alpha, fold = lora_alpha_for_gguf(adapter)
    w = GgufStreamWriter(path, base.arch.gguf_arch)
    try:
        w.kv.add_type(gguf.GGUFType.ADAPTER)
        w.kv.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.kv.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        w.kv.add_name(name)
        mods = list(adapter.modules.values())
        for m in mods:
            g = gguf_tensor_name(name_map, m.base_key)
            w.plan(g + ".lora_a", adapter.file.entries[m.a_key].shape, qtype)
            w.plan(g + ".lora_b", adapter.file.entries[m.b_key].shape, qtype)
        w.begin()
        for i, m in enumerate(mods):
            if before_tensor is not None:
                before_tensor(m.base_key)
            g = gguf_tensor_name(name_map, m.base_key)
            a = adapter.read(m.a_key).to(torch.float32)
            b = adapter.read(m.b_key).to(torch.float32)
            if fold:
                b = b * m.scale
            heads = _qk_heads(base, m.base_key)
            if heads is not None:
                b = permute_qk(b, heads)  # rows of B are the output rows llama.cpp permutes
            w.write(g + ".lora_a", encode(a, qtype))
            w.write(g + ".lora_b", encode(b, qtype))
            if after_tensor is not None:
                after_tensor(m.base_key, i, w.bytes_written, w.bytes_total)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return path.stat().st_size
