"""The bench's harness: the standard workload's model shapes, its saved random model and the baseline's loading
recipe, and the step measurements every script reports (peak memory, median step time, MFU/HFU).

A :class:`Workload` (a shape, a device and a dtype) is passed to whatever needs it; nothing here is module
state a script sets. ``workload(part, smoke)`` gives a part's (``PART_SHAPES``): Gemma 3 1B's shape for ``gemma``,
Llama 3.2 1B's for ``lora-1b`` and ``qlora-1b``, Qwen3-8B's for ``[q]lora-qwen3-8b``, Gemma 3 4B's for
``[q]lora-gemma3-4b``, else the 8B Llama's; ``smoke`` a tiny shape of the same architecture in fp32, the dtype
strop's kernels run in under the CPU interpreter.

The saved dir (``MODEL_ROOT``, a tiny BPE tokenizer beside the weights) is written once per machine by a child
process (``python -m lib.harness --write-model``, run from bench/) before any worker starts, so no worker's
time or memory includes it; a later run reuses it when its config matches and its max_position_embeddings
covers the longest point. RoPE is the default type (Gemma 3 4B's full layers: linear), neither of which reads
max_position_embeddings, so that value changes nothing in any step: it is written as ``MAX_POSITIONS`` once.

FLOP accounting (stated so MFU can be checked): see bench/train_bench.py's docstring; ``flops_per_token``
implements it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from strop.common.trainer_types import DEFAULT_TARGET_MODULES

from .profile import profile_summary

PEAK_TFLOPS = 790.0  # measured bf16 matmul ceiling: 788 on an H200, 798 on an H100 (DESIGN.md, KINDS.md)
# A shape: the dims of a released model's text config, ``name`` (its saved dir's) and ``model_type`` ("llama" when
# absent). Each is that model's published config.json; the bench writes random weights of it, never the weights.
LLAMA_SHAPE = dict(
    name="llama-8b", hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, head_dim=128
)
# --smoke: a tiny shape on the CPU, to check the harness itself without a GPU (numbers meaningless)
SMOKE_SHAPE = dict(LLAMA_SHAPE, hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=640, head_dim=32)
# The gemma part: Gemma 3 1B's shape (the GPU tier's parity test, tests/kernels/models/test_gemma.py), bf16 LoRA.
# window: the sliding layers' attention window; full_every: every 6th layer attends to the whole sequence.
GEMMA_SHAPE = dict(
    name="gemma3-1b",
    model_type="gemma3_text",
    hidden=1152,
    inter=6912,
    layers=26,
    heads=4,
    kv_heads=1,
    vocab=262144,
    head_dim=256,
    window=512,
    full_every=6,
)
SMOKE_GEMMA_SHAPE = dict(
    GEMMA_SHAPE, hidden=128, inter=256, layers=6, heads=4, kv_heads=1, vocab=640, head_dim=32, window=16
)
# The 1B parts: Llama 3.2 1B's shape (tied embeddings, as the released model), bf16 LoRA and QLoRA; a step's GPU
# work is a sixth of the 8B's, so the host's time per layer shows where the 8B's hides behind the GPU.
LLAMA_1B_SHAPE = dict(
    name="llama-1b",
    hidden=2048,
    inter=8192,
    layers=16,
    heads=32,
    kv_heads=8,
    vocab=128256,
    head_dim=64,
    tied=True,
)
SMOKE_1B_SHAPE = dict(SMOKE_SHAPE, name="llama-1b", tied=True)
# Qwen3-8B (Qwen/Qwen3-8B's config.json): per-head RMSNorm on q and k before RoPE, rope theta 1e6, untied head.
QWEN3_8B_SHAPE = dict(
    name="qwen3-8b",
    model_type="qwen3",
    hidden=4096,
    inter=12288,
    layers=36,
    heads=32,
    kv_heads=8,
    vocab=151936,
    head_dim=128,
)
SMOKE_QWEN3_SHAPE = dict(SMOKE_SHAPE, name="qwen3-8b", model_type="qwen3")
# Gemma 3 4B's text model (google/gemma-3-4b-it's text_config; the vocabulary is Gemma3TextConfig's default, which
# that config leaves unset: the checkpoint's embedding has 262,208 rows): GQA 8 / 4 heads of 256, window 1024 on
# five of every six layers, the full layers' RoPE positions scaled down 8× (linear), tied embeddings.
GEMMA3_4B_SHAPE = dict(
    name="gemma3-4b",
    model_type="gemma3_text",
    hidden=2560,
    inter=10240,
    layers=34,
    heads=8,
    kv_heads=4,
    vocab=262208,
    head_dim=256,
    window=1024,
    full_every=6,
    rope_linear=8.0,
)
SMOKE_GEMMA3_4B_SHAPE = dict(
    GEMMA3_4B_SHAPE, hidden=128, inter=256, layers=6, heads=4, kv_heads=2, vocab=640, head_dim=32, window=16
)
# The parts whose model is not the 8B Llama's: part -> (shape, its --smoke shape). The qlora-/lora- prefix says
# whether the base is NF4 (train_workers.QLORA_PARTS).
PART_SHAPES = {
    "gemma": (GEMMA_SHAPE, SMOKE_GEMMA_SHAPE),
    "lora-1b": (LLAMA_1B_SHAPE, SMOKE_1B_SHAPE),
    "qlora-1b": (LLAMA_1B_SHAPE, SMOKE_1B_SHAPE),
    "lora-qwen3-8b": (QWEN3_8B_SHAPE, SMOKE_QWEN3_SHAPE),
    "qlora-qwen3-8b": (QWEN3_8B_SHAPE, SMOKE_QWEN3_SHAPE),
    "lora-gemma3-4b": (GEMMA3_4B_SHAPE, SMOKE_GEMMA3_4B_SHAPE),
    "qlora-gemma3-4b": (GEMMA3_4B_SHAPE, SMOKE_GEMMA3_4B_SHAPE),
}
MAX_POSITIONS = 524288  # the longest context point (512K tokens at batch 1); default RoPE ignores it
MODEL_ROOT = "/tmp/strop-bench-models"
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def varied_lengths(seq: int, vary: int, batch: int, steps: int, seed: int = 4321) -> list[list[int]]:
    """``--vary-width``: each step's row lengths, drawn from a generator of their own, so every system trains the
    same sequence. Step i's width W is uniform in [seq − vary, seq] and its first row W long (a batch is padded to
    its longest row, as a chat SFT job's collator pads it); the other rows are uniform in [seq − vary, W]. Early
    in such a job nearly every step's width is one the process has not met."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lo = max(1, seq - vary)
    out = []
    for _ in range(steps):
        width = int(torch.randint(lo, seq + 1, (), generator=g))
        out.append([width, *(int(n) for n in torch.randint(lo, width + 1, (batch - 1,), generator=g))])
    return out


@dataclass
class Result:
    part: str
    system: str
    seq: int
    batch: int
    ok: bool = True
    error: str = ""
    steps: int = 0
    ms_per_step: float = 0.0
    tokens_per_s: float = 0.0
    peak_alloc_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    host_peak_rss_gib: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    losses: list[float] = field(default_factory=list)
    # DPO, ORPO, KTO, SimPO: rewards/margins of every step, warm-up included
    margins: list[float] = field(default_factory=list)
    build_s: float = 0.0
    notes: str = ""
    profile: str = ""
    # --vary-width: every step's time (ms, warm-up included) and its batch's width as it reached the model
    step_ms: list[float] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Workload:
    """The model shape a bench run trains, where and in which dtype; every model and measuring helper reads it."""

    shape: dict
    device: str = "cuda"
    dtype: str = "bfloat16"

    @property
    def smoke(self) -> bool:
        return self.device == "cpu"

    def flops_per_token(self, seq: int, r: int = 16, recompute: float = 1.0) -> tuple[float, float]:
        """(model, hardware) FLOPs per token; ``recompute`` is the fraction of layers whose forward reruns.

        Attention counts the keys a query sees on average: seq/2 causally, and for a sliding layer (Gemma) the
        window less the positions before it fills, w - w²/(2·seq)."""
        shape = self.shape
        h, i, L, v = shape["hidden"], shape["inter"], shape["layers"], shape["vocab"]
        q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        n_layer = L * (h * q + 2 * h * kv + q * h + 3 * h * i)
        n = n_layer + h * v
        lora = L * r * ((h + q) * 2 + (h + kv) * 2 + 2 * (h + i) + (i + h))
        window, every = shape.get("window"), shape.get("full_every", 1)
        full = L if window is None else L // every
        keys = full * seq / 2 + (L - full) * (
            min(window, seq) - min(window, seq) ** 2 / (2 * seq) if window else 0
        )
        attn = 2 * 2 * keys * q
        model = 4 * n + 3 * attn + 6 * lora
        hardware = model + recompute * (2 * n_layer + attn + 2 * lora)
        return model, hardware

    # ---- the model ------------------------------------------------------------------------------------------

    def model_config(self) -> dict:
        """``AutoConfig.for_model`` arguments of the shape's saved model, less max_position_embeddings (also what
        a saved dir must match)."""
        shape = self.shape
        model_type = shape.get("model_type", "llama")
        common = dict(
            model_type=model_type,
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["inter"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            head_dim=shape["head_dim"],
            use_cache=False,
            dtype="bfloat16",
        )
        if model_type == "llama":
            return dict(
                common,
                rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                tie_word_embeddings=bool(shape.get("tied")),
            )
        if model_type == "qwen3":  # Qwen3-8B's: q/k RMSNorm (always built by the architecture), no biases
            return dict(
                common,
                rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                tie_word_embeddings=False,
            )
        full_rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if "rope_linear" in shape:  # Gemma 3 4B's full layers: positions divided by the factor
            full_rope = {"rope_type": "linear", "factor": shape["rope_linear"], "rope_theta": 1_000_000.0}
        return dict(  # Gemma 3's: tied embeddings, GeGLU, soft-capping off, five sliding layers per full one
            common,
            rms_norm_eps=1e-6,
            sliding_window=shape["window"],
            sliding_window_pattern=shape["full_every"],
            query_pre_attn_scalar=shape["head_dim"],
            rope_parameters={
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            tie_word_embeddings=True,
        )

    def saved_model_dir(self) -> str:
        """The shape's saved random model's HF dir (each shape has its own, so none overwrites another)."""
        name = self.shape["name"]
        return os.path.join(MODEL_ROOT, f"{name}-smoke-shape" if self.device == "cpu" else f"{name}-shape")

    def ensure_saved_model(self, longest: int, part: str) -> None:
        """Orchestrator: unless this machine's saved dir of ``part``'s shape matches and covers ``longest``
        positions, write it in a child process (which frees its device memory on exit) and wait for it, before
        any worker is spawned."""
        try:
            with open(os.path.join(self.saved_model_dir(), "config.json")) as f:
                saved = json.load(f)
        except FileNotFoundError:
            saved = {}
        if saved.get("max_position_embeddings", 0) >= longest and all(
            saved.get(k) == v for k, v in self.model_config().items()
        ):
            return
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "lib.harness", "--write-model", str(max(MAX_POSITIONS, longest))]
        subprocess.run(
            [*cmd, "--part", part, *(["--smoke"] if self.smoke else [])], check=True, cwd=BENCH_DIR
        )
        print(f"wrote {self.saved_model_dir()} in {time.perf_counter() - t0:.0f} s", flush=True)

    def write_saved_model(self, positions: int) -> None:
        """The shape's random model (seed 0) as a bf16 safetensors HF dir, built on the device; renamed into
        place when complete."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

        path = self.saved_model_dir()
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        config = AutoConfig.for_model(**self.model_config(), max_position_embeddings=positions)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        make_bpe_tokenizer().save_pretrained(tmp)  # for the trainer service and TRL: ids are a vocab subset
        shutil.rmtree(path, ignore_errors=True)  # a dir that did not match
        os.replace(tmp, path)

    def load_model(self, qlora: bool):
        """The saved model, loaded the way DESIGN.md's baseline recipe loads it (NF4 double quant for QLoRA)."""
        import torch

        return load_saved(self.saved_model_dir(), qlora, getattr(torch, self.dtype), self.device)

    # ---- measuring ------------------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def reset_peak_memory(self) -> str:
        """Start the peaks ``record_peak_memory`` reads: GPU allocator stats and the host RSS high-water mark.

        Returns a note for the result when the host peak cannot be reset (it then counts loading too).
        """
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:  # "5" resets VmHWM (Linux >= 4.0): from_pretrained's reads of the weights stay out of the peak
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as exc:
            return f"\nhost RSS peak counts loading too: clear_refs refused ({exc})"
        return ""

    def record_peak_memory(self, res: Result) -> None:
        """GPU peak allocated/reserved and host peak RSS since ``reset_peak_memory``."""
        if self.device == "cuda":
            import torch

            res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
            res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
        res.host_peak_rss_gib = host_peak_rss_gib()

    def record_speed(
        self, res: Result, times: list[float], warmup: int, per_step: int, recompute: float | None
    ) -> None:
        """Median step time after warm-up; ``per_step`` tokens (DPO: pairs) per step; MFU/HFU unless
        ``recompute`` is None (the fraction of layers whose forward reruns)."""
        measured = sorted(times[warmup:])
        med = measured[len(measured) // 2]
        res.steps, res.ms_per_step, res.tokens_per_s = len(measured), med * 1e3, per_step / med
        if recompute is not None:
            model_f, hw_f = self.flops_per_token(res.seq, recompute=recompute)
            res.mfu = model_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
            res.hfu = hw_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)

    def record_varied_speed(
        self, res: Result, times: list[float], warmup: int, real_tokens: list[int], recompute: float
    ) -> None:
        """``--vary-width``: every step's time kept (``res.step_ms``, so a step's first meeting with a width shows
        against a repeat), the measured steps' mean (not their median, which would hide the first meetings) and
        tokens/s over the measured steps' real (non-pad) tokens, ``real_tokens[i]`` step i's; MFU/HFU counted as
        :meth:`record_speed` does, attention at ``res.seq`` (the widths' upper end: nominal)."""
        res.step_ms = [round(t * 1e3, 1) for t in times]
        measured, tokens = times[warmup:], real_tokens[warmup : len(times)]
        res.steps, res.ms_per_step = len(measured), sum(measured) / len(measured) * 1e3
        res.tokens_per_s = sum(tokens) / sum(measured)
        model_f, hw_f = self.flops_per_token(res.seq, recompute=recompute)
        res.mfu = model_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
        res.hfu = hw_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)

    def step_timer(self, times: list[float], profile_into: Result | None = None):
        """A TrainerCallback appending each optimizer step's wall time (device synchronised) to ``times``; with
        ``profile_into``, the trainer's last step runs under the profiler instead (the caller adds that step for
        ``--profile``), its summary goes to ``profile_into.profile`` and its time is not recorded."""
        from transformers import TrainerCallback

        sync = self.sync

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                sync()
                self.profiler = None
                if profile_into is not None and state.global_step + 1 == state.max_steps:
                    from torch.profiler import ProfilerActivity, profile

                    self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    self.profiler.__enter__()
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                sync()
                wall = time.perf_counter() - self.t
                if self.profiler is None:
                    times.append(wall)
                    return
                self.profiler.__exit__(None, None, None)
                profile_into.profile = profile_summary(self.profiler, wall)

        return StepTimer()


def workload(part: str, smoke: bool) -> Workload:
    """A part's workload: its shape in ``PART_SHAPES``, else the 8B Llama's, bf16 on CUDA (``smoke``: the tiny
    shape of the same architecture in fp32 on the CPU)."""
    shape, smoke_shape = PART_SHAPES.get(part, (LLAMA_SHAPE, SMOKE_SHAPE))
    if smoke:
        return Workload(dict(smoke_shape), device="cpu", dtype="float32")
    return Workload(dict(shape))


def attach_lora(model):
    """PEFT LoRA r=16 alpha=16 on all seven projections, the one adapter config of every system."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=list(DEFAULT_TARGET_MODULES),
    )
    return get_peft_model(model, cfg)  # autocast_adapter_dtype=True: LoRA weights fp32


def upcast_adapters_(model) -> None:
    """Trainable (LoRA) weights back to fp32 after a TRL trainer is built, as the trainer service does."""
    from strop.kernels.models.hf import keep_trainable_fp32

    keep_trainable_fp32(model)


def host_peak_rss_gib() -> float:
    """The process's RSS high-water mark (VmHWM) since ``reset_peak_memory``; pinned host buffers count."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def main() -> None:
    """``python -m lib.harness --write-model POSITIONS --part P [--smoke]`` (from bench/): the saved model's
    writer, run by ``Workload.ensure_saved_model`` in a child process."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--write-model", type=int, metavar="POSITIONS", required=True)
    p.add_argument("--part", default="qlora")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    workload(a.part, a.smoke).write_saved_model(a.write_model)


if __name__ == "__main__":
    main()


def load_saved(path, qlora: bool, dtype, device: str):
    """A saved model dir loaded as DESIGN.md's baseline recipe loads it: ``dtype`` weights, NF4 double quant with
    ``dtype`` compute for QLoRA, SDPA attention, on ``device`` ("cuda": the first GPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if qlora:
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        device_map={"": 0 if device == "cuda" else "cpu"},
        attn_implementation="sdpa",
        quantization_config=quant,
    )
