"""llama.cpp's quantizer (K-quants and friends) through llama-cpp-python's ``llama_model_quantize``.

The gguf package cannot produce K-quants, so strop writes an exact F32 GGUF of the merged weights and
hands it to llama.cpp's own quantizer with the ftype set explicitly (the C default is Q8_0: leaving
it unset silently produces the wrong file). Per-tensor choices (Q6_K for ``output``, more bits on some
``attn_v``/``ffn_down`` layers for ``_M`` types, F32 norms, fallbacks for rows not a multiple of 256)
are llama.cpp's.

``quantization_report`` says what a GGUF file holds: the tensor types read back from the written file
(``gguf.GGUFReader``) with counts, and every tensor written in another type than its file type asks
for, with the reason (llama.cpp logs its K-quant fallbacks: "ncols 576 not divisible by 256 (required
for type q4_K) -> falling back to q5_0"; those lines are captured during quantization).

The quantize-params struct is passed by ctypes, so its layout must match the vendored library:
llama-cpp-python is pinned exactly in pyproject.toml.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from strop.common.export_types import QuantFallback, QuantizationReport, TensorTypeCount
from strop.export_svc.core.errors import ConsumerRejected, UnknownFormat
from strop.export_svc.core.gguf_types import GGUF_TYPES, QT

_LOG_LOCK = threading.Lock()  # llama.cpp's log callback is process-global
_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_FALLBACK = re.compile(
    r"warning:\s+(\S+)\s+- ncols\s+(\d+) not divisible by (\d+) \(required for type\s+(\S+)\)"
    r" -> falling back to\s+(\S+)"
)
# llama.cpp's fallback table (llama-quant.cpp: a row width a K-quant's 256-wide super-block does not
# divide gets the first type, or F16 when that type's block does not divide it either), inverted: what a
# fallback type stood in for, for the tensors llama.cpp falls back without logging (output.weight).
_FALLBACK_OF = {"Q5_0": "Q4_K", "Q5_1": "Q5_K", "Q8_0": "Q6_K", "IQ4_NL": "Q2_K/Q3_K/IQ4_XS"}


@dataclass(frozen=True)
class LoggedFallback:
    """One fallback line of llama.cpp's quantizer log."""

    ncols: int
    block: int
    wanted: str
    written: str


def quantize_gguf(
    src: Path,
    dst: Path,
    gguf_type: str,
    *,
    nthread: int = 0,
    on_tensor: Callable[[int, int, str], None] | None = None,
    fallbacks: dict[str, LoggedFallback] | None = None,
) -> int:
    """Quantize the GGUF ``src`` (F32/F16/BF16) into ``dst`` as ``gguf_type``; returns dst's size.

    llama.cpp's log lines are captured (not printed); ``on_tensor(i, n, name)`` gets each
    "[ i/ n] name" progress line it logs, ``fallbacks`` (by tensor name) each fallback it logs.

    Raises:
        UnknownFormat: ``gguf_type`` is not a quantizer type of ``GGUF_TYPES``.
        ConsumerRejected: llama.cpp returned an error.
    """
    t = GGUF_TYPES.get(gguf_type)
    if t is None or t.direct:
        quantizer = sorted(n for n, x in GGUF_TYPES.items() if not x.direct)
        raise UnknownFormat(f"{gguf_type!r} is not a llama.cpp quantizer type; choose from {quantizer}")
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = t.file_type
    params.nthread = nthread or (os.cpu_count() or 1)
    params.allow_requantize = False
    params.quantize_output_tensor = True
    from llama_cpp import _logger

    pending = [""]  # llama.cpp logs a line in several calls: lines are matched once complete

    def on_line(line: str) -> None:
        m = _PROGRESS.search(line)
        if m and on_tensor is not None:
            on_tensor(int(m.group(1)), int(m.group(2)), m.group(3))
        f = _FALLBACK.search(line)
        if f and fallbacks is not None:
            fallbacks[f.group(1)] = LoggedFallback(
                int(f.group(2)), int(f.group(3)), f.group(4).upper(), f.group(5).upper()
            )

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        *done, pending[0] = (pending[0] + text.decode("utf-8", "replace")).split("\n")
        for line in done:
            on_line(line)

    with _LOG_LOCK:
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
            on_line(pending[0])
    if rc != 0 or not dst.is_file():
        raise ConsumerRejected(f"llama.cpp's quantizer failed for {gguf_type} (return code {rc})")
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
    return dst.stat().st_size


def _block_of(requested: str) -> int:
    """The row-width multiple the requested file type's main tensor type needs (K-quants: 256)."""
    t = GGUF_TYPES.get(requested)
    if t is not None and t.qtype is not None:
        import gguf

        return gguf.GGML_QUANT_SIZES[t.qtype][0]
    return 256 if "_K" in requested or requested == "IQ4_XS" else 32


def quantization_report(
    path: Path, requested: str, *, role: str = "model", logged: dict[str, LoggedFallback] | None = None
) -> QuantizationReport:
    """What ``path`` holds, read back from the file: tensor types with counts, and each fallback with why.

    A fallback is a weight (a tensor of 2 or more dimensions, norms aside: they stay F32 by design)
    written in another type than ``requested`` asks of it: one llama.cpp logged, or one whose row width
    the requested type's block does not divide (K-quants: 256; Q8_0 written by gguf-py: 32, as F16).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    logged = logged or {}
    counts: Counter[str] = Counter()
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    block = _block_of(requested)
    known = GGUF_TYPES.get(requested)
    direct = known.qtype if known is not None else None  # gguf-py wrote it: strop's own fallback rule
    n_weights = 0
    for t in reader.tensors:
        written = t.tensor_type.name
        counts[written] += 1
        shape = [int(x) for x in t.shape]  # GGML order: shape[0] is the row width (ncols)
        if len(shape) < 2 or t.name.endswith("_norm.weight"):
            continue
        n_weights += 1
        ncols = shape[0]
        if t.name in logged:
            lf = logged[t.name]
            groups.setdefault((lf.wanted, lf.written), []).append((t.name, lf.ncols))
        elif direct is not None and direct != QT.F32 and written != direct.name:
            groups.setdefault((direct.name, written), []).append((t.name, ncols))
        elif direct is None and ncols % block and written != "F32":
            wanted = _FALLBACK_OF.get(written, f"a {block}-block type of {requested}")
            groups.setdefault((wanted, written), []).append((t.name, ncols))
    fallbacks = []
    for (wanted, written), items in groups.items():
        widths = sorted({w for _, w in items})
        fallbacks.append(
            QuantFallback(
                wanted=wanted,
                written=written,
                count=len(items),
                reason=(
                    f"{'row widths' if len(widths) > 1 else 'row width'} {', '.join(map(str, widths))} "
                    f"{'are' if len(widths) > 1 else 'is'} not a multiple of {block}, which {wanted} "
                    f"needs; {'llama.cpp' if direct is None else 'strop'}'s fallback type is {written}"
                ),
                tensors=[n for n, _ in items],
            )
        )
    fallbacks.sort(key=lambda f: (-f.count, f.wanted))
    types = [TensorTypeCount(k, v) for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    written_s = ", ".join(f"{c.type} ×{c.count}" for c in types)
    n_fb = sum(f.count for f in fallbacks)
    if fallbacks:
        fb_s = "; ".join(f"{f.wanted}→{f.written} ×{f.count}" for f in fallbacks)
        summary = (
            f"{requested} requested; written: {written_s}; {n_fb} of {n_weights} weight tensors fell back "
            f"({fb_s}): their row width is not a multiple of {block}"
        )
    else:
        summary = f"{requested} requested; written: {written_s}; no fallbacks"
    return QuantizationReport(
        role=role,
        file=path.name,
        requested=requested,
        tensor_types=types,
        fallbacks=fallbacks,
        summary=summary,
    )


def report_metadata(r: QuantizationReport) -> dict[str, str]:
    """``r`` as flat artifact-metadata strings: ``quant.*`` (a GGUF LoRA's files: ``quant.base.*``,
    ``quant.lora.*``)."""
    prefix = "quant." if r.role == "model" else f"quant.{r.role}."
    out = {
        f"{prefix}file": r.file,
        f"{prefix}requested": r.requested,
        f"{prefix}tensor_types": ", ".join(f"{c.type}={c.count}" for c in r.tensor_types),
        f"{prefix}fallbacks": "; ".join(
            f"{f.wanted}->{f.written}={f.count} ({f.reason})" for f in r.fallbacks
        )
        or "none",
        f"{prefix}summary": r.summary,
    }
    return out
