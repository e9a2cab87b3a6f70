"""llama.cpp's quantizer (K-quants and friends) through llama-cpp-python's ``llama_model_quantize``.

The gguf package cannot produce K-quants, so strop writes an exact F32 GGUF of the merged weights and
hands it to llama.cpp's own quantizer with the ftype set explicitly (the C default is Q8_0: leaving
it unset silently produces the wrong file). Per-tensor choices (Q6_K for ``output``, more bits on some
``attn_v``/``ffn_down`` layers for ``_M`` types, F32 norms, fallbacks for rows not a multiple of 256)
are llama.cpp's.

The quantize-params struct is passed by ctypes, so its layout must match the vendored library:
llama-cpp-python is pinned exactly in pyproject.toml.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from strop.export_svc.core.errors import ConsumerRejected, UnknownFormat
from strop.export_svc.core.gguf_types import GGUF_TYPES

_LOG_LOCK = threading.Lock()  # llama.cpp's log callback is process-global
_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def quantize_gguf(
    src: Path,
    dst: Path,
    gguf_type: str,
    *,
    nthread: int = 0,
    on_tensor: Callable[[int, int, str], None] | None = None,
) -> int:
    """Quantize the GGUF ``src`` (F32/F16/BF16) into ``dst`` as ``gguf_type``; returns dst's size.

    llama.cpp's log lines are captured (not printed); ``on_tensor(i, n, name)`` gets each
    "[ i/ n] name" progress line it logs.

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

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        m = _PROGRESS.search(text.decode("utf-8", "replace"))
        if m and on_tensor is not None:
            on_tensor(int(m.group(1)), int(m.group(2)), m.group(3))

    with _LOG_LOCK:
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if rc != 0 or not dst.is_file():
        raise ConsumerRejected(f"llama.cpp's quantizer failed for {gguf_type} (return code {rc})")
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
    return dst.stat().st_size
