"""Small helpers shared by strop's Triton ops: input checks, launch settings and jit math.

Nothing here is an op. The checks raise real exceptions (TypeError for a wrong dtype or type, ValueError
for a wrong shape, device or layout) whose message names the argument, so a bad call from model code
fails at the launcher rather than as an illegal memory access inside a kernel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton import knobs

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Largest row one program holds in registers. 65,536 fp32 values is 256 KiB per program, past which the
# compiler spills; every row op in strop has rows far shorter (hidden ≤ 16,384).
MAX_FUSED_SIZE = 65536


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` for launch grids. Host code uses this, not ``triton.cdiv``: Triton 3.6 makes that a
    ``ConstexprFunction``, whose call from Python costs ~2 µs, several times per launch."""
    return -(-a // b)


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (in host memory) on ``device`` without a wait on the device's queue: to CUDA through pinned memory,
    copied asynchronously (torch's pinned-memory cache holds the block until the copy is done; a blocking copy, or
    one from pageable memory, waits for every kernel queued before it); elsewhere ``t.to(device)``."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (0 for 0), as ``triton.next_power_of_2`` without its call cost (see cdiv)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def calculate_settings(n: int) -> tuple[int, int]:
    """Block size and warp count for a kernel that keeps one row of ``n`` elements in registers.

    Args:
        n: Row length in elements.

    Returns:
        ``(BLOCK_SIZE, num_warps)``: the next power of two ≥ ``n`` and the warps to spread it over.

    Raises:
        ValueError: If ``n`` is not positive or exceeds ``MAX_FUSED_SIZE``.
    """
    if n < 1:
        raise ValueError(f"row length must be positive, got {n}")
    block = next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"row length {n} exceeds the fused limit of {MAX_FUSED_SIZE} elements per row")
    # untuned: chosen so each thread holds ≤ 16 elements (H=4096 → 8 warps × 32 lanes × 16), which keeps
    # a bf16 row in two 16-byte vector loads per lane without spilling.
    if block >= 32768:
        return block, 32
    if block >= 8192:
        return block, 16
    if block >= 2048:
        return block, 8
    return block, 4


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; 4 on the CPU (the Triton interpreter runs programs serially)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _sm_count(index)
    return 4


def check_float_tensor(t: object, name: str, *, ndim: int | None = None, min_ndim: int | None = None) -> None:
    """Raise unless ``t`` is a floating tensor (fp32/bf16/fp16) of the required rank.

    Raises:
        TypeError: If ``t`` is not a tensor or has a non-float dtype.
        ValueError: If its rank is wrong.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError unless every given (non-None) tensor lives on the same device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        found = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {found}")


def as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """View ``t`` as ``[rows, t.shape[-1]]`` with unit column stride, or None when no such view exists.

    Any row stride is allowed, so a column slice of a wider buffer (e.g. the gate half of a fused
    gate/up projection) is viewed without a copy.
    """
    # A last dim of size 1 has an arbitrary stride, but the kernels only ever address column 0 there.
    if t.dim() == 0 or (t.stride(-1) != 1 and t.shape[-1] != 1):
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def is_writable_in_place(t: torch.Tensor) -> bool:
    """True when no two elements of ``t`` share memory, so a kernel may overwrite it element by element.

    Expanded tensors (stride 0, e.g. the gradient of ``.sum()``) and other self-overlapping views fail.
    """
    dims = sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return False
        span = stride * size
    return True


# Triton 3.6's interpreter casts fp32 → bf16 by truncating the mantissa (round toward zero), where the
# compiled cast rounds to nearest even; `cast_to` rounds explicitly under the interpreter only.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _interpreter_skips_redundant_patching() -> bool:
    """Under ``TRITON_INTERPRET=1``, let a ``@triton.jit`` helper called from a running kernel skip re-patching
    the language modules the launch has patched already; True once installed.

    Triton 3.6's interpreter patches the language module of a kernel's globals (``_patch_lang``: ``triton.language``
    or ``triton.language.core``; every builtin of it, of its ``tensor`` and ``math``, the reduce/scan ops) once per
    launch and restores it when the launch ends; then at every call of a nested jit function
    (``InterpretedFunction.__call__``) it patches the modules of that function's globals again and discards the
    record. For a module the launch has patched that is the same assignment again, and it costs milliseconds a
    call; strop's kernels call small helpers (``cast_to``, the RoPE head loop, the activations) per program, so on
    a 2-core CI machine most of the CPU tier's library example went to it. A nested call whose modules are all patched
    in this launch now only runs the rewritten function; one that names another module (``tl.max`` is a jit
    function of ``triton.language.standard``, whose globals hold ``core``) is patched as before, and the launch
    remembers that module. Outside a launch, or on a Triton whose interpreter lacks these names, nothing changes;
    compiled kernels never get here.
    """
    try:
        import inspect

        from triton.runtime import interpreter as it

        grid_call, nested_call, patch = (
            it.GridExecutor.__call__,
            it.InterpretedFunction.__call__,
            it._patch_lang,
        )
        error = it.InterpreterError
    except (ImportError, AttributeError):
        return False
    if getattr(nested_call, "_strop_skips_patching", False):
        return True
    langs_of: dict[int, frozenset] = {}
    patched: list[set] = []  # per running launch: the language modules it has patched

    def langs(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs_of:
            mods = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            langs_of[key] = frozenset(id(m) for m in mods)
        return langs_of[key]

    def launch(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def nested(self, *args, **kwargs):
        if not patched:
            return nested_call(self, *args, **kwargs)
        mine = langs(self.fn)
        if not mine <= patched[-1]:
            patch(self.fn)  # as the interpreter does: patched until the launch restores them
            patched[-1] |= mine
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    nested._strop_skips_patching = True
    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = launch, nested
    return True


if INTERPRETER:
    _interpreter_skips_redundant_patching()


# A program's cost under the interpreter is its count of ops, nearly whatever its tile's size (numpy runs each op
# over the whole tile), so a kernel that keeps one row a program takes several rows a program there.
_INTERPRETER_TILE = 1 << 16


def interpreter_rows(m: int, block: int) -> int:
    """Rows a program for a row kernel of ``m`` rows of ``block`` elements: 1 compiled; under ``TRITON_INTERPRET=1``
    a power of two filling about 64K elements (at most ``next_power_of_2(m)``)."""
    if not INTERPRETER:
        return 1
    return max(1, min(next_power_of_2(m), _INTERPRETER_TILE // block))


# Rows a program of a row kernel over short rows (RMSNorm's, the MoE router's). Compiled: one where a row fills
# calculate_settings' warps, else a block of rows filling ROW_TILE elements: a q/k norm's rows (Qwen3's q_norm: one
# row of head_dim 128 a head and token) one a program would give each lane of 4 warps one element and launch a
# program a row. Not fitted to the row count (a few rows leave lanes masked): one compiled variant a row length, so
# a decode step's graph capture never compiles one. Under the interpreter, interpreter_rows' larger block.
ROW_TILE = 2048


def rows_a_program(n_rows: int, block: int) -> int:
    return max(1, interpreter_rows(n_rows, block), ROW_TILE // block)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` rounding to nearest even, on the GPU and in the interpreter alike."""
    if INTERPRETER:  # noqa: SIM102 (nested: the compiled path never evaluates the dtype test)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def tanh(x):
    """fp32 tanh from exp(−2|x|) ≤ 1, which never overflows; libdevice's tanh has no interpreter version."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype LoRA ops compute in: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# The stream query Triton's own launches use (torch's; CUDA builds only, where a bound launch runs).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class BoundLaunch:
    """A compiled Triton kernel's launch with every argument fixed but one tensor's pointer, re-launched without
    Triton's per-call work.

    ``kernel[grid](...)`` binds its arguments anew at every call: a specialization key per argument (dtype, 16-byte
    alignment of pointers, divisibility of integers), a cache key from them and the options, the compiled kernel's
    lookup, a check of the globals it read, then the driver's launcher. For a launch whose arguments are the same
    objects, integers and constexprs each time but for one tensor (an NF4 weight's dequantization into a scratch
    buffer: ``nf4.py``) that work finds the same compiled kernel every time, so the owner keeps this, made from the
    kernel its first launch returned, and calls the driver's launcher directly: the same binary with the same
    arguments, on the stream current at the call (as Triton's launch), the launch hooks honoured. The owner keys it
    on everything Triton's choice of compiled kernel reads that may change: the varying pointer's alignment
    (``data_ptr() % 16 == 0``), the current device, Triton's debug and instrumentation settings; and it checks
    before each replay that the fixed tensors are still what the kernel should read (the binding holds them, so
    their memory stays valid while it lives).
    """

    __slots__ = ("compiled", "function", "grid", "head", "metadata", "run", "tail")

    def __init__(self, compiled, grid: tuple[int, ...], args: Sequence, index: int) -> None:
        """``compiled``: what ``kernel[grid](*args, ...)`` returned; ``args``: every parameter of the kernel in order,
        constexprs included (the launcher skips those); ``index``: the one that varies."""
        self.compiled = compiled
        self.run = compiled.run  # loads the module and function handles where the first launch has not
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.grid = (*grid, 1, 1)[:3]
        self.head, self.tail = tuple(args[:index]), tuple(args[index + 1 :])

    def __call__(self, t: torch.Tensor, device: int) -> None:
        """Launch with ``t`` as the varying argument on ``device`` (the current CUDA device, in the owner's key)."""
        g0, g1, g2 = self.grid
        args = (*self.head, t, *self.tail)
        stream = _RAW_STREAM(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = None if enter is None else self.compiled.launch_metadata(self.grid, stream, *args)
        self.run(g0, g1, g2, stream, self.function, self.metadata, meta, enter, leave, *args)
