"""Training benchmark on the standard workload of DESIGN.md: HF + PEFT baseline vs strop, each in its own process.

Workload: Llama-3.1-8B shape (hidden 4096, inter 14336, 32 layers, 32/8 heads, vocab 128256), random
weights, LoRA r=16 alpha=16 on all seven projections, gradient checkpointing, seq 2048, batch 8; QLoRA
(NF4 double quant) and bf16 LoRA. The same random tokens and seed for every system.

Baseline recipe (DESIGN.md): transformers + PEFT as a user writes it — the random model saved once as a
bf16 safetensors dir and loaded with ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16,
device_map={"": 0}, attn_implementation="sdpa")``, with ``BitsAndBytesConfig`` (NF4, double quant, bf16
compute) for the QLoRA parts (qlora, context, dpo); no prepare_model_for_kbit_training, LoRA weights fp32,
bf16 autocast, gradient checkpointing with use_reentrant=False, torch.optim.AdamW(lr=1e-4),
PYTORCH_ALLOC_CONF=expandable_segments:True. Every system loads that dir with ``load_model`` (the trainer
service with its own loader, which passes the same dtype and BitsAndBytesConfig); strop's library path is
the baseline's loop on that model after ``strop.kernels.models.patch_model(model)``.

The saved dir (/tmp/strop-bench-models/, tiny BPE tokenizer beside the weights) is written once per machine
by a child of the orchestrator before any worker starts, so no worker's time or memory includes it; a
later run reuses it when its config matches and its max_position_embeddings covers the longest point.
RoPE is the default type, which never reads max_position_embeddings, so that value changes nothing in any
step: it is written as 524,288 (the longest context point) once, and the config is the same for every
system and part.

DPO part: TRL DPOTrainer (baseline) vs strop's chunked DPO loss, 8B QLoRA, 4 pairs of prompt 512 +
completion 512 per step. Every step trains on the same 4 pairs (the dataset is those 4 rows, one epoch
per step), so the reward margin can trend; each step's margin is recorded and the report says whether
the last is above the first.

ORPO, KTO and SimPO parts: the same shape and fixed batch with TRL's ORPOTrainer, KTOTrainer and
CPOTrainer(loss_type="simpo", cpo_alpha=0) on HF + PEFT (baseline) vs the same trainers on strop's chunked
losses (``strop_{orpo,kto,cpo}_trainer_class``); hyperparameters from the trainer service's defaults table
(``TRAIN_DEFAULTS``), lr ``DPO_LR``. KTO unpairs the 4 pairs into 8 rows (4 desirable, 4 undesirable: the
same 8 sequences per step, plus TRL's 8 mismatched KL rows, scored without gradients); its rate is rows/s.

Gemma part (``--parts gemma``): Gemma 3 1B's shape (hidden 1152, inter 6912, 26 layers, 4 heads / 1 KV head
of 256, vocab 262,144, tied embeddings, window 512 on five of every six layers), saved and loaded the same
way, bf16 LoRA with the same adapter config and loop; systems ``baseline``, ``strop``, ``strop-standard``.

FLOP accounting (stated so MFU can be checked):
    N      = parameters in matmuls per token (7 projections x 32 layers + lm_head)
    attn   = causal attention per token, forward: 2 * 2 * layers * seq/2 * heads*head_dim (QK^T and PV, half
             masked; a sliding layer's keys per query are its window w less w²/(2·seq), not seq/2)
    model FLOPs/token    = 2N + 2N (forward, backward dX; the frozen base has no weight gradient)
                           + 3 * attn (attention forward + backward dQ, dK, dV) + LoRA (negligible, counted)
    hardware FLOPs/token = model FLOPs + 2N_layers + attn (gradient checkpointing recomputes each layer's forward;
                           scaled by the fraction of layers that recompute under budgeted recompute)
    MFU = model FLOPs/token * tokens/s / 790 TFLOP/s (the H200's measured bf16 matmul ceiling); HFU likewise
    with hardware FLOPs.

Usage (on the GPU machine)::

    python bench/train_bench.py --parts qlora,lora --systems baseline,strop --steps 8 --json bench/out/train.json
    python bench/train_bench.py --parts dpo --systems baseline,strop --steps 8 --warmup 0
    python bench/train_bench.py --parts orpo,kto,simpo --systems baseline,strop-standard --steps 8 --warmup 0
    python bench/train_bench.py --parts gemma --systems baseline,strop,strop-standard --profile
    python bench/train_bench.py --parts context --systems baseline,strop-long-context --context 65536,131072,262144,524288

Systems: ``baseline`` (HF + PEFT), ``strop`` (``patch_model``, plain checkpointing), and the trainer's memory
modes by name, each installed by ``strop.kernels.models.apply_memory_mode`` from the one table the service uses
(``strop.common.trainer_types.MEMORY_MODES``): ``strop-standard`` (checkpointed layer inputs in pinned host
memory: the trainer's default on CUDA), ``strop-standard-sN`` (the same with N evenly spaced layers not
recomputed: their saved activations go to pinned host memory and come back ahead of need; HFU counts the
recompute saved), ``strop-long-context`` (+ the MLP tiled over the sequence), ``strop-max-speed`` (budgeted
recompute under an 80 GiB budget, enforced on the process with ``torch.cuda.set_per_process_memory_fraction``:
only as many layers recompute as the budget needs; the first warm-up step calibrates),
``…-f8`` after any strop system: the frozen bases' GEMMs in FP8 (``patch_model(fp8_base=True)``, opt-in and
inexact; its MFU is nominal: bf16-equivalent FLOPs over the bf16 ceiling), ``…-f8dx``: only their backward dx GEMMs
(``fp8_base="dx"``), ``trl-lib`` (a user's script: from_pretrained + PEFT + ``patch_model`` + TRL SFTTrainer on pre-tokenized rows,
its fused LM head on strop's kernel: ``strop_sft_trainer_class``; ``trl-lib-trlhead``: with TRL's own head;
``trl-lib-svcargs``: with what the service adds in process, its optimizer, token count and gradient guard)
and ``service`` (the same through the trainer service over gRPC on localhost; ``--profile`` profiles its last
step from the client's thread: the GPU timeline is whole, the job thread's Python ops are not seen).

Each (part, system) runs in a fresh subprocess (``--worker``) and prints one ``RESULT {json}`` line. Peak
memory (GPU allocated/reserved, host RSS) is reset after loading and setup, so it is the training steps'.
``--smoke`` runs a tiny shape on the CPU through the same save + from_pretrained path (fp32, NF4 with fp32
compute for the QLoRA parts; strop's kernels under ``TRITON_INTERPRET=1``): it checks the harness, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from strop.common.trainer_types import DEFAULT_TARGET_MODULES

PEAK_TFLOPS = 790.0  # measured bf16 matmul ceiling on the H200 (DESIGN.md, KINDS.md)
LLAMA_SHAPE = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, head_dim=128)
SHAPE = dict(LLAMA_SHAPE)  # the model of the part in hand (use_shape)
# --smoke: a tiny shape on the CPU, to check the harness itself without a GPU (numbers meaningless)
SMOKE_SHAPE = dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=640, head_dim=32)
# The gemma part: Gemma 3 1B's shape (the GPU tier's parity test, tests/kernels/models/test_gemma.py), bf16 LoRA.
# window: the sliding layers' attention window; full_every: every 6th layer attends to the whole sequence.
GEMMA_SHAPE = dict(
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
    hidden=128, inter=256, layers=6, heads=4, kv_heads=1, vocab=640, head_dim=32, window=16, full_every=6
)
GEMMA_PARTS = ("gemma",)
DEVICE = "cuda"
DTYPE = "bfloat16"  # --smoke: float32, the dtype strop's kernels run in under the CPU interpreter
FAST_BUDGET_GIB = 80  # the memory-allowed mode's cap (issue 5)
QLORA_PARTS = ("qlora", "context", "dpo", "orpo", "kto", "simpo")
# trained by TRL's preference trainers on the fixed batch of DPO pairs (run_dpo_worker, run_preference_worker)
PREFERENCE_PARTS = ("dpo", "orpo", "kto", "simpo")
MAX_POSITIONS = 524288  # the longest context point (512K tokens at batch 1); default RoPE ignores it
MODEL_ROOT = "/tmp/strop-bench-models"
# prompt and completion tokens of a DPO pair (--smoke: 24, the CPU runs the kernels interpreted)
DPO_HALF = 512
# TRL's default lr 5e-6 hardly moves the margin from random weights in 8 steps (the H200 baseline's did not
# visibly move, DESIGN.md; the smoke shape's rose 0.0006 a step). Adam steps each weight by about lr whatever
# the gradient's scale and the LoRA B matrices start at zero, so early on the margin rises in proportion to
# lr (smoke: 0.011 a step at 1e-4). 1e-4 is the SFT recipe's AdamW lr; the same for every system.
DPO_LR = 1e-4


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


def flops_per_token(seq: int, r: int = 16, recompute: float = 1.0) -> tuple[float, float]:
    """(model, hardware) FLOPs per token; ``recompute`` is the fraction of layers whose forward reruns.

    Attention counts the keys a query sees on average: seq/2 causally, and for a sliding layer (Gemma) the
    window less the positions before it fills, w - w²/(2·seq)."""
    h, i, L, v = SHAPE["hidden"], SHAPE["inter"], SHAPE["layers"], SHAPE["vocab"]
    q, kv = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    n_layer = L * (h * q + 2 * h * kv + q * h + 3 * h * i)
    n = n_layer + h * v
    lora = L * r * ((h + q) * 2 + (h + kv) * 2 + 2 * (h + i) + (i + h))
    window, every = SHAPE.get("window"), SHAPE.get("full_every", 1)
    full = L if window is None else L // every
    keys = full * seq / 2 + (L - full) * (
        min(window, seq) - min(window, seq) ** 2 / (2 * seq) if window else 0
    )
    attn = 2 * 2 * keys * q
    model = 4 * n + 3 * attn + 6 * lora
    hardware = model + recompute * (2 * n_layer + attn + 2 * lora)
    return model, hardware


# -------------------------------------------------------------------------------------------- the model


def use_shape(part: str, smoke: bool) -> None:
    """Set SHAPE to the part's model: Gemma 3 1B's for the gemma part, else the 8B Llama's (--smoke: tiny)."""
    SHAPE.clear()
    if part in GEMMA_PARTS:
        SHAPE.update(SMOKE_GEMMA_SHAPE if smoke else GEMMA_SHAPE)
    else:
        SHAPE.update(SMOKE_SHAPE if smoke else LLAMA_SHAPE)


def model_config() -> dict:
    """``AutoConfig.for_model`` arguments of SHAPE's saved model, less max_position_embeddings (also what a
    saved dir must match)."""
    common = dict(
        model_type="gemma3_text" if "window" in SHAPE else "llama",
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["inter"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
        use_cache=False,
        dtype="bfloat16",
    )
    if "window" not in SHAPE:
        return dict(
            common,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        )
    return dict(  # Gemma 3 1B's: tied embeddings, GeGLU, soft-capping off, five sliding layers per full one
        common,
        rms_norm_eps=1e-6,
        sliding_window=SHAPE["window"],
        sliding_window_pattern=SHAPE["full_every"],
        query_pre_attn_scalar=SHAPE["head_dim"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


def saved_model_dir() -> str:
    """SHAPE's saved random model's HF dir (each shape has its own, so none overwrites another)."""
    name = "gemma3-1b" if "window" in SHAPE else "llama-8b"
    return os.path.join(
        MODEL_ROOT, f"{name.split('-')[0]}-smoke-shape" if DEVICE == "cpu" else f"{name}-shape"
    )


def ensure_saved_model(longest: int, part: str) -> None:
    """Orchestrator: unless this machine's saved dir of ``part``'s shape matches and covers ``longest``
    positions, write it in a child process (which frees its device memory on exit) and wait for it, before
    any worker is spawned."""
    try:
        with open(os.path.join(saved_model_dir(), "config.json")) as f:
            saved = json.load(f)
    except FileNotFoundError:
        saved = {}
    if saved.get("max_position_embeddings", 0) >= longest and all(
        saved.get(k) == v for k, v in model_config().items()
    ):
        return
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--write-model", str(max(MAX_POSITIONS, longest))]
    subprocess.run([*cmd, "--part", part, *(["--smoke"] if DEVICE == "cpu" else [])], check=True)
    print(f"wrote {saved_model_dir()} in {time.perf_counter() - t0:.0f} s", flush=True)


def write_saved_model(positions: int) -> None:
    """SHAPE's random model (seed 0) as a bf16 safetensors HF dir, built on DEVICE; renamed into place when
    complete."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

    path = saved_model_dir()
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    config = AutoConfig.for_model(**model_config(), max_position_embeddings=positions)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    make_bpe_tokenizer().save_pretrained(tmp)  # for the trainer service and TRL: ids are a vocab subset
    shutil.rmtree(path, ignore_errors=True)  # a dir that did not match
    os.replace(tmp, path)


def load_model(qlora: bool):
    """The saved model, loaded the way DESIGN.md's baseline recipe loads it (NF4 double quant for QLoRA)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, DTYPE)
    quant = None
    if qlora:
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    return AutoModelForCausalLM.from_pretrained(
        saved_model_dir(),
        dtype=dtype,
        device_map={"": 0 if DEVICE == "cuda" else "cpu"},
        attn_implementation="sdpa",
        quantization_config=quant,
    )


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


# ------------------------------------------------------------------------------------------- measuring


def reset_peak_memory() -> str:
    """Start the peaks ``record_peak_memory`` reads: GPU allocator stats and the host RSS high-water mark.

    Returns a note for the result when the host peak cannot be reset (it then counts loading too).
    """
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:  # "5" resets VmHWM (Linux >= 4.0): from_pretrained's reads of the weights stay out of the peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        return f"\nhost RSS peak counts loading too: clear_refs refused ({exc})"
    return ""


def host_peak_rss_gib() -> float:
    """The process's RSS high-water mark (VmHWM) since ``reset_peak_memory``; pinned host buffers count."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def record_peak_memory(res: Result) -> None:
    """GPU peak allocated/reserved and host peak RSS since ``reset_peak_memory``."""
    if DEVICE == "cuda":
        import torch

        res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
        res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    res.host_peak_rss_gib = host_peak_rss_gib()


def record_speed(
    res: Result, times: list[float], warmup: int, per_step: int, recompute: float | None
) -> None:
    """Median step time after warm-up; ``per_step`` tokens (DPO: pairs) per step; MFU/HFU unless
    ``recompute`` is None (the fraction of layers whose forward reruns)."""
    measured = sorted(times[warmup:])
    med = measured[len(measured) // 2]
    res.steps, res.ms_per_step, res.tokens_per_s = len(measured), med * 1e3, per_step / med
    if recompute is not None:
        model_f, hw_f = flops_per_token(res.seq, recompute=recompute)
        res.mfu = model_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
        res.hfu = hw_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)


def sync() -> None:
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def step_timer(times: list[float], profile_into: Result | None = None):
    """A TrainerCallback appending each optimizer step's wall time (device synchronised) to ``times``; with
    ``profile_into``, the trainer's last step runs under the profiler instead (``trl_args`` adds that step for
    ``--profile``), its summary goes to ``profile_into.profile`` and its time is not recorded."""
    from transformers import TrainerCallback

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


def profiled(a) -> int:
    """1 where this TRL-trainer worker profiles one extra, last step (``--profile`` on CUDA), else 0."""
    return int(bool(a.profile) and DEVICE == "cuda")


def trl_args(config_cls, a, **kw):
    """``config_cls`` (SFTConfig, DPOConfig) with what every TRL system shares: ``a.batch`` rows per step,
    warm-up + measured steps at a constant lr, non-reentrant checkpointing, a log line per step, no saving."""
    import tempfile

    return config_cls(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=a.batch,
        max_steps=a.warmup + a.steps + profiled(a),  # the profiled step is the last, not timed
        lr_scheduler_type="constant",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=DEVICE == "cuda",
        use_cpu=DEVICE != "cuda",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **kw,
    )


def profile_step(step) -> str:
    """One step under torch.profiler, summarised by :func:`profile_summary`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return profile_summary(prof, time.perf_counter() - t0)


def profile_summary(prof, wall: float) -> str:
    """A profiled step's wall and GPU busy time, the top GPU kernels by total time, and the top host ops by self
    CPU time (a step whose GPU idles waits on them: Python, launches, syncs)."""
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type.name == "CUDA" and not e.key.startswith("phase:")]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [
        f"step {wall * 1e3:.0f} ms under the profiler; GPU busy {total / 1e3:.0f} ms in "
        f"{sum(e.count for e in events)} kernels; top 25 by self time:"
    ]
    for e in events[:25]:
        share = e.self_device_time_total / total
        lines.append(f"  {e.self_device_time_total / 1e3:8.1f} ms {share:6.1%} x{e.count:<5d} {e.key[:110]}")
    lines.extend(gpu_timeline(prof))
    host = sorted((e for e in averages if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    lines.append("top 15 host ops by self CPU time (total, per call):")
    for e in host[:15]:
        per = e.self_cpu_time_total / max(e.count, 1)
        lines.append(f"  {e.self_cpu_time_total / 1e3:8.1f} ms {per:8.1f} us x{e.count:<5d} {e.key[:100]}")
    return "\n".join(lines)


KERNEL_KINDS = (  # (kind, pattern over the kernel's name), first match wins
    ("copy", r"^Memcpy|^Memset"),
    ("GEMM", r"nvjet|gemm|cutlass|sm90_xmma|splitK"),
    ("attention", r"sdpa|flash|fmha|cudnn"),
    ("gather/scatter", r"index|scatter|gather"),
    ("strop triton", r"^_|fused_linear_ce"),
    ("nf4 (bitsandbytes)", r"kDequantize|kgemm_4bit"),
)


def gpu_timeline(prof) -> list[str]:
    """Where a profiled step's GPU time goes: self time by kernel kind; how long the GPU computed at all (union
    of the non-copy kernels' intervals over the span from the first kernel to the last), the rest of the span
    being the GPU waiting on the host (launches, Python, syncs); and that idle time by what the host was doing
    when it began: the ``phase:`` range (``label_phases``) and the innermost host op open at that moment."""
    import bisect

    events = prof.events()
    kernels = [  # record_function ranges (the phases) are mirrored on the device timeline: not kernels
        e
        for e in events
        if e.device_type.name == "CUDA"
        and e.time_range.end > e.time_range.start
        and not e.name.startswith("phase:")
        and not getattr(e, "is_user_annotation", False)
    ]
    if not kernels:
        return []
    kinds: dict[str, float] = {}
    spans = []
    for e in kernels:
        kind = next((k for k, pat in KERNEL_KINDS if re.search(pat, e.name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + (e.time_range.end - e.time_range.start)
        if kind != "copy":
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    gaps = []  # (start, length) of each stretch with no compute kernel running
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s - cur_e))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    out = [
        f"GPU span {span / 1e3:.0f} ms: computing {busy / 1e3:.0f} ms, idle {(span - busy) / 1e3:.0f} ms "
        f"({(span - busy) / span:.1%}) in {len(gaps)} gaps; by kind:"
    ]
    out += [f"  {v / 1e3:8.1f} ms  {k}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    cpu = sorted(
        (e for e in events if e.device_type.name == "CPU" and e.time_range.end > e.time_range.start),
        key=lambda e: e.time_range.start,
    )
    phases = [e for e in cpu if e.name.startswith("phase:")]
    starts = [e.time_range.start for e in cpu]
    by_phase: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for t, length in gaps:
        open_phases = [p for p in phases if p.time_range.start <= t <= p.time_range.end]
        phase = max(open_phases, key=lambda p: p.time_range.start).name if open_phases else "phase:none"
        by_phase[phase] = by_phase.get(phase, 0.0) + length
        if length < 20:  # µs: launch latency, not worth naming
            continue
        inner, end = None, bisect.bisect_right(starts, t)
        for e in reversed(cpu[max(0, end - 400) : end]):  # the innermost op started last; 400 back is plenty
            if e.time_range.end >= t and not e.name.startswith("phase:"):
                inner = e.name
                break
        by_op[inner or "?"] = by_op.get(inner or "?", 0.0) + length
    out.append("GPU idle by the host's phase when the gap began:")
    out += [f"  {v / 1e3:8.1f} ms  {k}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    out.append("GPU idle (gaps of 20 us or more) by the innermost host op open when the gap began, top 12:")
    out += [f"  {v / 1e3:8.1f} ms  {k[:100]}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]]
    return out


def memory_at_peak(step, top: int = 14) -> str:
    """Run ``step`` under CUDA's allocation history and say what was allocated at its peak: the blocks the step
    allocated and still held at that moment, grouped by the innermost frame in strop, transformers, peft, trl or
    this file (allocations from before the step, the weights and optimizer state, are the baseline)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    sizes: dict[int, int] = {}
    cur = peak = peak_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif ev["action"] == "free_requested" and ev["addr"] in sizes:  # what the allocator stops counting
            cur -= sizes.pop(ev["addr"])
    live: dict[int, dict] = {}
    for ev in trace[: peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    ours = re.compile(r"strop|/kernels/|transformers/|peft/|trl/|train_bench")
    groups: dict[str, list[int]] = {}
    for ev in live.values():
        frame = next((f for f in ev.get("frames", []) if ours.search(f["filename"])), None)
        key = "?" if frame is None else f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
        g = groups.setdefault(key, [0, 0])
        g[0] += ev["size"]
        g[1] += 1
    lines = [
        f"memory at the step's peak: {base / 2**30:.2f} GiB before the step + {peak / 2**30:.2f} GiB the step "
        f"held then ({len(live)} blocks); by innermost frame:"
    ]
    for key, (nbytes, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {nbytes / 2**30:7.3f} GiB x{n:<4d} {key[:110]}")
    return "\n".join(lines)


def label_phases(obj, **methods: str) -> None:
    """Wrap ``obj``'s methods (attribute name → label) in ``torch.profiler.record_function("phase:<label>")`` so
    a profiled step's idle GPU time is attributed to them (:func:`gpu_timeline`); costs nothing unprofiled."""
    import functools

    import torch

    for name, label in methods.items():
        fn = getattr(obj, name)

        def wrapped(*args, _fn=fn, _label=label, **kwargs):
            with torch.profiler.record_function(f"phase:{_label}"):
                return _fn(*args, **kwargs)

        functools.update_wrapper(wrapped, fn)
        setattr(obj, name, wrapped)


# ---------------------------------------------------------------------------------------------- workers


def memory_system(system: str):
    """``strop-<mode>[-sN][-aB][-tB]`` → (MemoryMode, N, attention, tiled): the trainer's memory modes by the names the service uses.

    ``strop-standard`` (checkpointed layer inputs in pinned host memory, what the trainer's default mode does
    on CUDA), ``strop-long-context`` (+ the tiled MLP), ``strop-max-speed`` (budgeted recompute under
    ``FAST_BUDGET_GIB``); ``-sN``: N evenly spaced layers skip the recompute, their activations in host memory;
    ``-a1``/``-a0``: offloaded layers keep (or do not keep) their attention output for the recompute, whatever
    the mode's default (``MemoryFeatures.save_attention``); the third item is None without it. ``-t1``/``-t0``:
    the MLPs run tiled (or not), whatever the mode's default (``MemoryFeatures.tiled_mlp``); the fourth item. None for ``baseline`` and ``strop`` (kernels only, plain checkpointing). Before 2026-12-01 (bench/RESULTS.md)
    these were called strop-offload[-sN], strop-mem and strop-fast.
    """
    from strop.common.trainer_types import MemoryMode

    system = re.sub(r"-f8(dx)?$", "", system)  # FP8 base GEMMs (fp8_system) combine with any mode
    m = re.fullmatch(r"strop-(standard|long-context|max-speed)(?:-s(\d+))?(?:-a([01]))?(?:-t([01]))?", system)
    if m is None:
        return None
    attention = None if m.group(3) is None else m.group(3) == "1"
    tiled = None if m.group(4) is None else m.group(4) == "1"
    return MemoryMode(m.group(1).replace("-", "_").upper()), int(m.group(2) or 0), attention, tiled


def fp8_system(system: str) -> bool | str:
    """``patch_model``'s ``fp8_base`` for a system: ``strop…-f8`` True, ``strop…-f8dx`` "dx" (the opt-in FP8 GEMMs
    for the frozen bases, all or the backward's dx; inexact; MFU and HFU still count bf16-equivalent FLOPs against
    the bf16 ceiling, so they are nominal for these systems), else False."""
    if not system.startswith("strop"):
        return False
    return "dx" if system.endswith("-f8dx") else system.endswith("-f8")


def apply_memory(model, system: str, batch: int, seq: int):
    """Install the system's memory mode through the installer the trainer uses, the same way: the table's row
    (with the system's ``-sN``/``-aB``/``-tB`` variant replaced into it), the step's shape for the host-room rule,
    and MAX_SPEED's budget as a job's ``memory_budget_gib`` would give it."""
    import dataclasses

    import torch

    from strop.common.trainer_types import MEMORY_MODES, MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode

    spec = memory_system(system)
    if spec is None:
        return None
    mode, save_layers, save_attention, tiled = spec
    if DEVICE != "cuda" and mode is MemoryMode.MAX_SPEED:
        return None  # --smoke: budgeted recompute measures CUDA memory
    features = MEMORY_MODES[mode]
    variant = {"save_layers": save_layers, "save_attention": save_attention, "tiled_mlp": tiled}
    features = dataclasses.replace(features, **{k: v for k, v in variant.items() if v is not None and v != 0})
    budget = FAST_BUDGET_GIB * 2**30 if features.budgeted_recompute else 0
    if DEVICE == "cuda" and budget:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    smoke = {} if DEVICE == "cuda" else {"offload_cpu_tensors": True, "min_offload_bytes": 0}  # --smoke
    return apply_memory_mode(
        model, features, step=StepShape(batch, seq), budget_bytes=budget, device=DEVICE, **smoke
    )


def run_worker(a) -> Result:
    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(load_model(a.part in QLORA_PARTS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.system.startswith("strop"):
        from strop.kernels.models import patch_model

        res.notes = str(patch_model(model, fp8_base=fp8_system(a.system)))
    installed = apply_memory(model, a.system, a.batch, a.seq)
    model.train()
    if a.progress:
        log_layer_progress(model, a.progress)
    res.build_s = time.perf_counter() - t0
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    data = torch.randint(0, SHAPE["vocab"], (a.batch, a.seq), device=DEVICE, generator=g)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    res.notes += reset_peak_memory()
    times = []
    for _ in range(a.warmup + a.steps):
        sync()
        ts = time.perf_counter()
        loss = train_step(model, opt, data)
        sync()
        times.append(time.perf_counter() - ts)
        res.losses.append(round(float(loss.detach()), 5))
        if installed is not None and installed.step_end() is not None:
            res.notes += f"\nbudgeted recompute: {installed.recompute.plan}"
            res.notes += reset_peak_memory()  # the peak reported is the planned steps'
    record_peak_memory(res)
    if installed is not None:
        res.notes += "\n" + str(installed)  # after training: what was offloaded
        if installed.memory is not None and installed.memory.offloader is not None:
            res.notes += f"\n{installed.memory.offloader!r}"
    if a.profile and DEVICE == "cuda":
        res.profile = profile_step(lambda: train_step(model, opt, data))
        try:
            res.profile += "\n" + memory_at_peak(lambda: train_step(model, opt, data))
        except Exception as exc:  # a diagnostic: its failure must not lose the measured run
            res.profile += f"\nmemory at peak: not recorded ({exc!r})"
    recompute = 1.0
    plan = installed.recompute.plan if installed is not None and installed.recompute is not None else None
    if plan is not None:
        recompute = 1 - plan.uncheckpointed / plan.layers
    saved_layers = (memory_system(a.system) or (None, 0))[1]
    if saved_layers:  # never the last layer
        recompute = 1 - min(saved_layers, SHAPE["layers"] - 1) / SHAPE["layers"]
    record_speed(res, times, a.warmup, a.batch * a.seq, recompute)
    return res


def log_layer_progress(model, path: str) -> None:
    """Append a line to ``path`` as each decoder layer ends its forward and as backward reaches it (before its
    recompute), after a device sync: the time, the peak GPU memory so far and the host's peak RSS. A step too
    long for the caller's time limit still leaves how far it got and the peaks on the way."""
    import torch

    from strop.kernels.models.hf import checkpoint_layers, unwrap_peft

    t0 = time.perf_counter()

    def log(i: int, kind: str) -> None:
        sync()
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
        with open(path, "a") as f:
            f.write(f"{time.perf_counter() - t0:9.1f} s  layer {i:2d} {kind:8s}  GPU peak {peak:6.1f} GiB  "
                    f"host peak RSS {host_peak_rss_gib():6.1f} GiB\n")  # fmt: skip

    def hook(i):
        def post(module, args, out):
            log(i, "forward")
            h = out[0] if isinstance(out, tuple) else out
            if isinstance(h, torch.Tensor) and h.requires_grad:
                h.register_hook(lambda g: log(i, "backward"))

        return post

    for i, layer in enumerate(checkpoint_layers(unwrap_peft(model))):
        layer.register_forward_hook(hook(i))


def train_step(model, opt, data):
    import torch

    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        loss = model(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run_trl_worker(a) -> Result:
    """SFT through TRL on the saved model: ``trl-lib`` in-process (a user's script: from_pretrained, PEFT,
    ``patch_model``, offloaded checkpointing, SFTTrainer) or ``service`` through the trainer service over
    gRPC on localhost (whose standard memory mode on CUDA offloads the checkpointed inputs the same way).

    Both train the same pre-tokenized rows (batch x seq random ids) with gradient checkpointing, AdamW
    lr 1e-4, bf16, fp32 adapters; the service reports each step's time in its events.
    """
    import tempfile

    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 640, (a.batch, a.seq), generator=g)  # ids of the saved tiny tokenizer
    rows = [{"input_ids": ids[i].tolist()} for i in range(a.batch)] * (a.warmup + a.steps)
    qlora = a.part in QLORA_PARTS
    times: list[float] = []
    if a.system == "service":
        from strop.client import KernelMode, LoraConfig, Quantization, TrainConfig, TrainerClient, TrainMethod
        from strop.trainer_svc.core.trainer_core import TrainerConfig
        from strop.trainer_svc.server import start

        work = tempfile.mkdtemp()
        service = start(
            TrainerConfig(model_root=MODEL_ROOT, artifact_root=work + "/a", state_dir=work + "/s")
        )
        with TrainerClient(f"127.0.0.1:{service.port}") as tc:
            s = tc.load_model(
                os.path.basename(saved_model_dir()),
                dtype=DTYPE,
                quantization=Quantization.NF4 if qlora else Quantization.NONE,
                kernels=KernelMode.UNSPECIFIED,
            )
            s = tc.attach_lora(s.session_id, LoraConfig(r=16, alpha=16))
            res.notes = s.facts.kernels_reason
            ds = tc.upload_dataset(rows)
            res.build_s = time.perf_counter() - t0
            cfg = TrainConfig(
                method=TrainMethod.SFT,
                learning_rate=1e-4,
                lr_scheduler="constant",
                batch_size=a.batch,
                max_length=a.seq,
                max_steps=a.warmup + a.steps + profiled(a),  # the profiled step is the last, not timed
                gradient_checkpointing=True,
                optimizer="adamw_torch",
                seed=0,
            )
            res.notes += reset_peak_memory()  # the service trains in this process: the same readers apply
            prof = None
            for e in tc.train(s.session_id, ds.dataset_id, cfg):
                if e.step is not None and e.step.step > a.warmup + a.steps:  # the profiled step has ended
                    try:  # a diagnostic: its failure must not lose the measured run
                        prof.__exit__(None, None, None)
                        res.profile = profile_summary(prof, e.step.step_seconds)
                    except Exception as exc:
                        res.profile = f"profile not recorded ({exc!r})"
                elif e.step is not None:
                    res.losses.append(round(e.step.loss, 5))
                    times.append(e.step.step_seconds)
                    if profiled(a) and e.step.step == a.warmup + a.steps:
                        # from the client's thread, as the job thread starts the next step: CUPTI sees every
                        # kernel of the process, so the GPU timeline (idle time, kernel kinds) is the step's
                        from torch.profiler import ProfilerActivity, profile

                        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                        prof.__enter__()
                elif e.state is not None and e.state.state.value == "FAILED":
                    raise RuntimeError(e.state.message)
            record_peak_memory(res)
        service.stop(grace=1.0)
    else:
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        from strop.kernels.models import patch_model
        from strop.kernels.trainers import strop_sft_trainer_class

        model = attach_lora(load_model(qlora))
        res.notes = str(patch_model(model))
        memory = apply_memory(model, "strop-standard", a.batch, a.seq)  # the service's default mode on CUDA
        # TRL's SFTTrainer with its fused LM head on strop's kernel; trl-lib-trlhead: TRL's own head (before 2026-12-03)
        trainer_cls = SFTTrainer if a.system == "trl-lib-trlhead" else strop_sft_trainer_class()
        # trl-lib-svcargs: what the service adds to the in-process run (its optimizer name, its token count and
        # its gradient guard), to tell those from the service's threads and gRPC
        svc = a.system == "trl-lib-svcargs"
        extra = dict(optim="adamw_torch", include_num_input_tokens_seen="non_padding") if svc else {}
        trainer = trainer_cls(
            model=model,
            args=trl_args(SFTConfig, a, learning_rate=1e-4, max_length=a.seq, **extra),
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(saved_model_dir()),
            callbacks=[step_timer(times, res if profiled(a) else None)],
        )
        if svc:
            from strop.trainer_svc.core.guard import make_guard

            trainer.add_callback(make_guard(model))
        upcast_adapters_(model)
        res.build_s = time.perf_counter() - t0
        res.notes += reset_peak_memory()
        trainer.train()
        record_peak_memory(res)
        res.notes += "\n" + str(memory)
        res.losses = [round(float(h["loss"]), 5) for h in trainer.state.log_history if "loss" in h]
    record_speed(res, times, a.warmup, a.batch * a.seq, 1.0)
    return res


def dpo_dataset(n_rows: int, prompt_tokens: int, completion_tokens: int):
    """Preference rows of about ``prompt_tokens`` + ``completion_tokens`` with the tiny BPE tokenizer.

    The 8B-shape model has no tokenizer of its own; the tiny byte-level BPE's ids are a subset of its
    vocabulary, and every system gets the same rows, so the work per step is identical.
    """
    from datasets import Dataset

    from strop.fixtures.corpus import sentences
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

    tok = make_bpe_tokenizer()
    text = " ".join(sentences(40 * n_rows * (prompt_tokens + 2 * completion_tokens) // 64, seed=7))
    ids = tok(text)["input_ids"]
    rows, pos = [], 0
    for _ in range(n_rows):
        parts = []
        for n in (prompt_tokens, completion_tokens, completion_tokens):
            parts.append(tok.decode(ids[pos : pos + n]))
            pos += n
        rows.append({"prompt": parts[0], "chosen": parts[1], "rejected": parts[2]})
    return tok, Dataset.from_list(rows)


def train_preference(res: Result, a, trainer, model, t0: float, times: list[float], rows: int) -> None:
    """Apply ``a.system``'s memory features, train, and record into ``res`` the build time (since ``t0``), peak
    memory, per-step losses and reward margins (NaN where a step logs none) and ``rows`` per second."""
    # as the trainer sizes a preference step: two rows per pair (KTO: each row and its KL row) of max_length
    memory = apply_memory(model, a.system, 2 * a.batch, trainer.args.max_length)
    res.build_s = time.perf_counter() - t0
    res.notes += reset_peak_memory()
    label_phases(trainer, compute_loss="loss and its forwards")
    label_phases(trainer.accelerator, backward="backward")
    if hasattr(trainer, "_strop_reference_hidden"):
        label_phases(trainer, _strop_reference_hidden="reference forward")
    trainer.train()
    record_peak_memory(res)
    if memory is not None:
        res.notes += "\n" + str(memory)  # after training: what was offloaded
    logs = [h for h in trainer.state.log_history if "loss" in h]
    res.losses = [round(float(h["loss"]), 5) for h in logs]
    res.margins = [round(float(h.get("rewards/margins", float("nan"))), 5) for h in logs]
    record_speed(res, times, a.warmup, rows, None)


def run_dpo_worker(a) -> Result:
    """TRL DPOTrainer on HF + PEFT (baseline, as TRL users run it) vs strop's DPO path, 8B QLoRA.

    ``a.batch`` pairs (4) of prompt 512 + completion 512, the same pairs every step: the dataset is those
    rows, so each step is one epoch over them (in shuffled order, the same mean loss). Gradient
    checkpointing, lr ``DPO_LR``, reference = the base with the adapter disabled, TRL's default for a PEFT
    model (the same for both systems). strop: ``patch_model`` + the chunked DPO loss
    (``strop_dpo_trainer_class``) with fp32 adapters, as the trainer service runs it.
    """
    from trl import DPOConfig, DPOTrainer

    res = Result(part="dpo", system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(load_model(qlora=True))
    half = a.seq // 2
    tok, data = dpo_dataset(a.batch, half, half)
    trainer_cls = DPOTrainer
    strop = a.system.startswith("strop")
    if strop:
        from strop.kernels.models import patch_model
        from strop.kernels.trainers import strop_dpo_trainer_class

        res.notes = str(patch_model(model))
        trainer_cls = strop_dpo_trainer_class()
    times: list[float] = []
    trainer = trainer_cls(
        model=model,
        ref_model=None,
        args=trl_args(DPOConfig, a, learning_rate=DPO_LR, beta=0.1, max_length=2 * half),
        train_dataset=data,
        processing_class=tok,
        callbacks=[step_timer(times, res if profiled(a) else None)],
    )
    if strop:
        upcast_adapters_(model)
    train_preference(res, a, trainer, model, t0, times, a.batch)  # pairs per second for this part
    if strop:
        res.notes += f"\nbatches with each pair's prompt run once: {trainer.strop_shared_batches}"
    return res


def preference_trainer(part: str):
    """(TRL trainer, its config, strop's trainer class builder, config fields) of an ORPO, KTO or SimPO part."""
    from strop.common.trainer_types import TRAIN_DEFAULTS as D
    from strop.kernels import trainers

    if part == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        # ORPOConfig.beta is the paper's λ
        return ORPOTrainer, ORPOConfig, trainers.strop_orpo_trainer_class, dict(beta=D["orpo_lambda"])
    if part == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        fields = dict(loss_type="simpo", cpo_alpha=0.0, beta=D["simpo_beta"], simpo_gamma=D["simpo_gamma"])
        return CPOTrainer, CPOConfig, trainers.strop_cpo_trainer_class, fields
    from trl import KTOConfig, KTOTrainer

    fields = dict(
        beta=D["kto_beta"],
        desirable_weight=D["kto_desirable_weight"],
        undesirable_weight=D["kto_undesirable_weight"],
    )
    return KTOTrainer, KTOConfig, trainers.strop_kto_trainer_class, fields


def run_preference_worker(a) -> Result:
    """TRL's ORPO / KTO / SimPO trainer on HF + PEFT (baseline) vs the same trainer on strop's chunked loss, 8B
    QLoRA, ``a.batch`` pairs of prompt 512 + completion 512 (KTO: their 2·``a.batch`` rows), the same every
    step; the rest as ``run_dpo_worker`` (KTO's reference: the base with the adapter disabled)."""
    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(load_model(qlora=True))
    half = a.seq // 2
    tok, data = dpo_dataset(a.batch, half, half)
    rows = a.batch
    if a.part == "kto":
        from datasets import Dataset

        unpaired = [
            {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in data
            for k in ("chosen", "rejected")
        ]
        data, rows = Dataset.from_list(unpaired), 2 * a.batch
    trainer_cls, config_cls, strop_class, fields = preference_trainer(a.part)
    strop = a.system.startswith("strop")
    if strop:
        from strop.kernels.models import patch_model

        res.notes = str(patch_model(model))
        trainer_cls = strop_class()
    times: list[float] = []
    args = trl_args(config_cls, a, learning_rate=DPO_LR, max_length=2 * half, **fields)
    args.per_device_train_batch_size = rows
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[step_timer(times, res if profiled(a) else None)],
    )
    if a.part == "kto" and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # the reference is the base (adapter disabled), as in the trainer service
        model.set_adapter("default")
    if strop:
        upcast_adapters_(model)
        if getattr(trainer, "_strop_reason", None):
            res.notes += f"\nchunked loss off: {trainer._strop_reason}"
    train_preference(res, a, trainer, model, t0, times, rows)  # pairs (KTO: rows) per second
    return res


# ------------------------------------------------------------------------------------------ orchestrator


def part_points(part: str, a) -> list[tuple[int, int]]:
    """(seq, batch) points of a part; DPO's seq is a pair's prompt + completion."""
    if part == "context":
        return [(int(s), 1) for s in a.context.split(",")]
    if part in PREFERENCE_PARTS:
        return [(2 * DPO_HALF, 4)]  # 4 pairs per step
    return [(a.seq, a.batch)]


def spawn(part: str, system: str, seq: int, batch: int, a) -> Result:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"  # strop's kernels on the CPU (read when they are first imported)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--part",
        part,
        "--system",
        system,
        "--seq",
        str(seq),
        "--batch",
        str(batch),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        *(["--smoke"] if a.smoke else []),
        *(["--profile"] if a.profile else []),
        *(["--progress", a.progress] if a.progress else []),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return Result(part, system, seq, batch, ok=False, error=f"timeout after {a.timeout}s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return Result(**json.loads(line[7:]))
    tail = (proc.stderr or proc.stdout)[-1500:]
    oom = "OutOfMemoryError" in tail or "CUDA out of memory" in tail
    return Result(
        part,
        system,
        seq,
        batch,
        ok=False,
        error=("OOM" if oom else f"rc={proc.returncode}: {tail}"),
        build_s=time.perf_counter() - t0,
    )


def rate(r: Result) -> str:
    """tokens/s, or pairs/s (a few per second) for DPO, ORPO and SimPO (KTO: rows/s)."""
    if r.part in PREFERENCE_PARTS:
        return f"{r.tokens_per_s:.2f} {'rows' if r.part == 'kto' else 'pairs'}/s"
    return f"{r.tokens_per_s:,.0f} tok/s"


def margin_rose(r: Result) -> str:
    return "rose" if r.margins[-1] > r.margins[0] else "did not rise"


def table(results: list[Result]) -> str:
    base = {(r.part, r.seq): r for r in results if r.system == "baseline" and r.ok}
    rows = [
        "| part | system | seq x batch | speed | ms/step | peak alloc GiB | peak reserved GiB | host RSS GiB "
        "| MFU | HFU | speed vs base | mem vs base | first losses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.part} | {r.system} | {r.seq} x {r.batch} | {r.error[:60]} | | | | | | | | | |")
            continue
        b = base.get((r.part, r.seq))
        sp = f"{r.tokens_per_s / b.tokens_per_s:.2f}x" if b else "-"
        mem = f"{r.peak_alloc_gib / b.peak_alloc_gib:.2f}x" if b and b.peak_alloc_gib else "-"
        rows.append(
            f"| {r.part} | {r.system} | {r.seq} x {r.batch} | {rate(r)} | {r.ms_per_step:,.0f} | "
            f"{r.peak_alloc_gib:.1f} | {r.peak_reserved_gib:.1f} | {r.host_peak_rss_gib:.1f} | {r.mfu:.1%} | "
            f"{r.hfu:.1%} | {sp} | {mem} | {', '.join(f'{x:.4f}' for x in r.losses[:3])} |"
        )
    dpo = [r for r in results if r.ok and r.margins]
    if dpo:
        rows += [
            "",
            "Reward margin on the fixed batch, every step (warm-up included):",
            "",
            "| part | system | margins | last > first |",
            "|---|---|---|---|",
        ]
        rows += [
            f"| {r.part} | {r.system} | {', '.join(f'{m:.5f}' for m in r.margins)} | {margin_rose(r)} |"
            for r in dpo
        ]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument(
        "--write-model", type=int, metavar="POSITIONS", help=argparse.SUPPRESS
    )  # ensure_saved_model's
    p.add_argument("--part", default="qlora")
    p.add_argument("--system", default="baseline")
    p.add_argument("--parts", default="qlora,lora")
    p.add_argument("--systems", default="baseline,strop")
    p.add_argument("--seq", type=int, help="tokens per row (default 2048; --smoke: 64)")
    p.add_argument("--batch", type=int, help="rows per step (default 8; --smoke: 2)")
    # batch 1; a run stops at a system's first failing point, so 524288 costs time only where 262144 fits
    p.add_argument("--context", default="16384,32768,65536,131072,262144,524288")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="also profile one step per system (GPU kernels)")
    p.add_argument(
        "--progress", help="append each decoder layer's start (time, peaks) to this file (SFT parts)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    a = p.parse_args()
    if a.smoke:
        global DEVICE, DTYPE, DPO_HALF
        DEVICE, DTYPE, DPO_HALF = "cpu", "float32", 24
    use_shape(a.part, a.smoke)  # a worker's (and --write-model's) part; the orchestrator sets it per part
    # --smoke: few tokens, as the Triton interpreter runs strop's kernels at ~10 s a step for 64 x 2
    a.seq = a.seq or (64 if a.smoke else 2048)
    a.batch = a.batch or (2 if a.smoke else 8)
    if a.write_model:
        write_saved_model(a.write_model)
        return
    if a.worker:
        try:
            if a.part == "dpo":
                res = run_dpo_worker(a)
            elif a.part in PREFERENCE_PARTS:
                res = run_preference_worker(a)
            elif a.system in ("service", "trl-lib", "trl-lib-trlhead", "trl-lib-svcargs"):
                res = run_trl_worker(a)
            else:
                res = run_worker(a)
        except Exception as exc:  # reported, not raised: the orchestrator records it
            import traceback

            traceback.print_exc()
            oom = "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc)
            res = Result(a.part, a.system, a.seq, a.batch, ok=False, error="OOM" if oom else repr(exc)[:300])
        print("RESULT " + json.dumps(asdict(res)), flush=True)
        return
    parts = {part: part_points(part, a) for part in a.parts.split(",")}
    for family in ({p for p in parts if p in GEMMA_PARTS}, {p for p in parts if p not in GEMMA_PARTS}):
        if family:
            use_shape(min(family), a.smoke)
            ensure_saved_model(max(seq for p in family for seq, _ in parts[p]), min(family))
    results: list[Result] = []
    for part, points in parts.items():
        for system in a.systems.split(","):
            for seq, batch in points:
                r = spawn(part, system, seq, batch, a)
                results.append(r)
                line = f"{rate(r)}, {r.peak_alloc_gib:.1f} GiB" if r.ok else r.error[:200]
                if r.ok and r.margins:
                    line += f", margin {r.margins[0]:.5f} -> {r.margins[-1]:.5f} ({margin_rose(r)})"
                print(f"{part} {system} {seq}x{batch}: {line}", flush=True)
                if part == "context" and not r.ok:
                    break  # longer contexts will not fit either
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(table(results))
    for r in results:
        if r.notes or r.profile:
            print(f"\n## {r.part} {r.system} {r.seq}x{r.batch}\n{r.notes}\n{r.profile}")


if __name__ == "__main__":
    main()
