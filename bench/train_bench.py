"""Training benchmark on the standard workload of DESIGN.md: HF + PEFT baseline vs strop, each in its own process.

Workload: Llama-3.1-8B shape (hidden 4096, inter 14336, 32 layers, 32/8 heads, vocab 128256), random
weights, LoRA r=16 alpha=16 on all seven projections, gradient checkpointing, seq 2048, batch 8; QLoRA
(NF4 double quant) and bf16 LoRA. The same random tokens and seed for every system.

Baseline recipe (DESIGN.md): transformers + PEFT as a user writes it — no prepare_model_for_kbit_training,
LoRA weights fp32, bf16 autocast, SDPA, gradient checkpointing with use_reentrant=False,
torch.optim.AdamW(lr=1e-4), PYTORCH_ALLOC_CONF=expandable_segments:True. strop's library path is the
same loop on the same model after ``strop.kernels.patch_model(model)``.

FLOP accounting (stated so MFU can be checked):
    N      = parameters in matmuls per token (7 projections x 32 layers + lm_head)
    attn   = causal attention per token, forward: 2 * 2 * layers * seq/2 * hidden (QK^T and PV, half masked)
    model FLOPs/token    = 2N + 2N (forward, backward dX; the frozen base has no weight gradient)
                           + 3 * attn (attention forward + backward dQ, dK, dV) + LoRA (negligible, counted)
    hardware FLOPs/token = model FLOPs + 2N_layers + attn (gradient checkpointing recomputes each layer's forward;
                           scaled by the fraction of layers that recompute under budgeted recompute)
    MFU = model FLOPs/token * tokens/s / 790 TFLOP/s (the H200's measured bf16 matmul ceiling); HFU likewise
    with hardware FLOPs.

Usage (on the GPU machine)::

    python bench/train_bench.py --parts qlora,lora --systems baseline,strop --steps 8 --json bench/out/train.json
    python bench/train_bench.py --parts context --systems baseline,strop-mem --context 16384,32768,65536,131072,262144

Systems: ``baseline`` (HF + PEFT), ``strop`` (``patch_model``), ``strop-mem`` (``patch_model`` +
``enable_memory_features``: offloaded checkpointing and the tiled MLP, strop's long-context mode),
``strop-offload`` (``patch_model`` + offloaded checkpointing alone, no tiling), ``strop-offload-sN`` (the same
with N evenly spaced layers not recomputed: their saved activations go to pinned host memory and come back
ahead of need; HFU counts the recompute saved), ``strop-fast`` (the memory-allowed mode: ``patch_model`` +
``enable_budgeted_recompute`` with an 80 GiB budget, enforced on the process with ``torch.cuda.set_per_process_memory_fraction``: only as many layers recompute
as the budget needs; the first warm-up step calibrates),
``trl-lib`` (a user's script: from_pretrained + PEFT + ``patch_model`` + TRL SFTTrainer on pre-tokenized rows)
and ``service`` (the same through the trainer service over gRPC on localhost) — the last two load the model
from a saved dir, so the first of them to run writes the random 8B-shape weights to /tmp once.

Each (part, system) runs in a fresh subprocess (``--worker``) and prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

PEAK_TFLOPS = 790.0  # measured bf16 matmul ceiling on the H200 (DESIGN.md, KINDS.md)
SHAPE = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, head_dim=128)
# --smoke: a tiny shape on the CPU, to check the harness itself without a GPU (numbers meaningless)
SMOKE_SHAPE = dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=640, head_dim=32)
DEVICE = "cuda"
FAST_BUDGET_GIB = 80  # the memory-allowed mode's cap (issue 5)


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
    build_s: float = 0.0
    notes: str = ""
    profile: str = ""


def flops_per_token(seq: int, r: int = 16, recompute: float = 1.0) -> tuple[float, float]:
    """(model, hardware) FLOPs per token; ``recompute`` is the fraction of layers whose forward reruns."""
    h, i, L, v = SHAPE["hidden"], SHAPE["inter"], SHAPE["layers"], SHAPE["vocab"]
    kv = SHAPE["kv_heads"] * SHAPE["head_dim"]
    n_layer = L * (h * h + 2 * h * kv + h * h + 3 * h * i)
    n = n_layer + h * v
    lora = L * r * ((h + h) * 2 + (h + kv) * 2 + 2 * (h + i) + (i + h))
    attn = 2 * 2 * L * (seq / 2) * h
    model = 4 * n + 3 * attn + 6 * lora
    hardware = model + recompute * (2 * n_layer + attn + 2 * lora)
    return model, hardware


# ---------------------------------------------------------------------------------------------- worker


def build_model(mode: str, seq: int):
    """The 8B-shape model with random weights, on the GPU; QLoRA quantizes every decoder linear to NF4."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["inter"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        max_position_embeddings=max(seq, 8192),
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    if mode == "qlora" and DEVICE == "cuda":
        quantize_nf4_(model)
    model.config.use_cache = False
    return model


def quantize_nf4_(model) -> None:
    """Swap each decoder nn.Linear for a bnb Linear4bit (NF4, double quant, bf16 compute), layer by layer.

    The same modules ``from_pretrained(..., BitsAndBytesConfig(load_in_4bit=True, nf4, double quant))``
    builds (lm_head and embeddings stay bf16), without writing 16 GB of random weights to disk first.
    """
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    lin.in_features,
                    lin.out_features,
                    bias=lin.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
                ).to("cuda")
                setattr(parent, name, q)
                del lin
        torch.cuda.empty_cache()


def attach_lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(model, cfg)  # autocast_adapter_dtype=True: LoRA weights fp32


def offload_spec(system: str) -> int | None:
    """``strop-offload`` → 0, ``strop-offload-s12`` → 12 layers without recompute; None for other systems."""
    m = re.fullmatch(r"strop-offload(?:-s(\d+))?", system)
    return None if m is None else int(m.group(1) or 0)


def enable_offload(model, system: str):
    """strop-offload[-sN]: checkpointed layer inputs in pinned host memory, no MLP tiling; with -sN, N evenly
    spaced layers are not recomputed (their saved activations go to host memory instead)."""
    from strop.kernels.memory import enable_memory_features

    smoke = {} if DEVICE == "cuda" else {"offload_cpu_tensors": True, "min_offload_bytes": 0}  # --smoke
    return enable_memory_features(model, tiled_mlp_chunks=None, save_layers=offload_spec(system), **smoke)


def run_worker(a) -> Result:
    import resource

    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = build_model("qlora" if a.part in ("qlora", "context") else "lora", a.seq)
    model = attach_lora(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.system.startswith("strop"):
        from strop.kernels import patch_model

        report = patch_model(model)
        res.notes = str(report)
    memory, saved_layers = None, offload_spec(a.system)
    if a.system == "strop-mem":
        # the long-context mode: layer inputs offloaded to pinned host memory + MLP tiled over the sequence
        from strop.kernels.memory import enable_memory_features

        memory = enable_memory_features(model, tiled_mlp_chunks="auto")
    elif saved_layers is not None:
        memory = enable_offload(model, a.system)
    model.train()
    res.build_s = time.perf_counter() - t0
    cuda = DEVICE == "cuda"
    planner = None
    if a.system == "strop-fast" and cuda:
        from strop.kernels.recompute import enable_budgeted_recompute

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, FAST_BUDGET_GIB * 2**30 / total))
        planner = enable_budgeted_recompute(model, FAST_BUDGET_GIB * 2**30)
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    data = torch.randint(0, SHAPE["vocab"], (a.batch, a.seq), device=DEVICE, generator=g)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
        ts = time.perf_counter()
        loss = train_step(model, opt, data)
        if cuda:
            torch.cuda.synchronize()
        res.losses.append(round(float(loss.detach()), 5))
        if step >= a.warmup:
            times.append(time.perf_counter() - ts)
        if planner is not None and planner.plan is None and planner.step_end() is not None:
            res.notes += f"\nbudgeted recompute: {planner.plan}"
            torch.cuda.reset_peak_memory_stats()  # the peak reported is the planned steps'
    if memory is not None:
        res.notes += "\n" + str(memory) + f"\n{memory.offloader!r}"  # after training: what was offloaded
    if a.profile and cuda:
        res.profile = profile_step(lambda: train_step(model, opt, data))
    times.sort()
    med = times[len(times) // 2]
    tokens = a.batch * a.seq
    recompute = 1.0
    if planner is not None and planner.plan is not None:
        recompute = 1 - planner.plan.uncheckpointed / planner.plan.layers
    if saved_layers:  # never the last layer
        recompute = 1 - min(saved_layers, SHAPE["layers"] - 1) / SHAPE["layers"]
    model_f, hw_f = flops_per_token(a.seq, recompute=recompute)
    res.steps = len(times)
    res.ms_per_step = med * 1e3
    res.tokens_per_s = tokens / med
    if cuda:
        res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
        res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    res.host_peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res.mfu = model_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
    res.hfu = hw_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
    return res


def train_step(model, opt, data):
    import torch

    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        loss = model(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def profile_step(step) -> str:
    """One step under torch.profiler: the top GPU kernels by total time, and the step's GPU busy time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [f"GPU busy {total / 1e3:.0f} ms in {sum(e.count for e in events)} kernels; top 25 by self time:"]
    for e in events[:25]:
        share = e.self_device_time_total / total
        lines.append(f"  {e.self_device_time_total / 1e3:8.1f} ms {share:6.1%} x{e.count:<5d} {e.key[:110]}")
    return "\n".join(lines)


def step_timer(times: list[float]):
    """A TrainerCallback appending each optimizer step's wall time (device synchronised) to ``times``."""
    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.t)

    return StepTimer()


def median_after_warmup(times: list[float], warmup: int) -> tuple[int, float]:
    measured = sorted(times[warmup:])
    return len(measured), measured[len(measured) // 2]


SAVED_MODEL = "/tmp/strop-bench-models/llama-8b-shape"


def saved_model_dir(seq: int) -> str:
    """The random 8B-shape model as a bf16 HF dir (written once per machine; tiny BPE tokenizer beside it).

    The trainer service loads models from disk, so the service and TRL-library systems start from this
    directory (NF4 quantized on load for QLoRA) instead of building the model in memory.
    """
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

    if not os.path.isfile(os.path.join(SAVED_MODEL, "config.json")):
        model = build_model("lora", seq)
        model.save_pretrained(SAVED_MODEL + ".tmp", safe_serialization=True)
        make_bpe_tokenizer().save_pretrained(SAVED_MODEL + ".tmp")
        del model
        os.replace(SAVED_MODEL + ".tmp", SAVED_MODEL)
    return SAVED_MODEL


def run_trl_worker(a) -> Result:
    """SFT through TRL on the saved model: ``trl-lib`` in-process (a user's script: from_pretrained, PEFT,
    ``patch_model``, offloaded checkpointing, SFTTrainer) or ``service`` through the trainer service over
    gRPC on localhost (whose standard memory mode on CUDA offloads the checkpointed inputs the same way).

    Both train the same pre-tokenized rows (batch x seq random ids) with gradient checkpointing, AdamW
    lr 1e-4, bf16; the service reports each step's time and peak memory in its events.
    """
    import tempfile

    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model_dir = saved_model_dir(a.seq)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 640, (a.batch, a.seq), generator=g)  # ids of the saved tiny tokenizer
    rows = [{"input_ids": ids[i].tolist()} for i in range(a.batch)] * (a.warmup + a.steps)
    qlora = a.part == "qlora"
    times: list[float] = []
    if a.system == "service":
        from strop.client import KernelMode, LoraConfig, Quantization, TrainConfig, TrainerClient, TrainMethod
        from strop.trainer_svc.core.trainer import TrainerConfig
        from strop.trainer_svc.server import start

        work = tempfile.mkdtemp()
        running, _core = start(
            TrainerConfig(
                model_root=os.path.dirname(model_dir), artifact_root=work + "/a", state_dir=work + "/s"
            )
        )
        with TrainerClient(f"127.0.0.1:{running.port}") as tc:
            s = tc.load_model(
                os.path.basename(model_dir),
                dtype="bfloat16" if DEVICE == "cuda" else "float32",
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
                max_steps=a.warmup + a.steps,
                gradient_checkpointing=True,
                optimizer="adamw_torch",
                seed=0,
            )
            for e in tc.train(s.session_id, ds.dataset_id, cfg):
                if e.step is not None:
                    res.losses.append(round(e.step.loss, 5))
                    times.append(e.step.step_seconds)
                    res.peak_alloc_gib = e.step.peak_memory_bytes / 2**30
                elif e.state is not None and e.state.state.value == "FAILED":
                    raise RuntimeError(e.state.message)
        running.stop(grace=1.0)
    else:
        from datasets import Dataset
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
        from trl import SFTConfig, SFTTrainer

        from strop.kernels import patch_model

        kw = {"dtype": torch.bfloat16, "device_map": {"": 0 if DEVICE == "cuda" else "cpu"}}
        if qlora and DEVICE == "cuda":
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
        model = get_peft_model(
            model,
            LoraConfig(
                r=16,
                lora_alpha=16,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
        res.notes = str(patch_model(model))
        # what the service does in its standard mode on CUDA: checkpointed inputs offloaded, no tiling
        from strop.kernels.memory import enable_memory_features

        memory = enable_memory_features(model, tiled_mlp_chunks=None)

        args = SFTConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=a.batch,
            max_length=a.seq,
            max_steps=a.warmup + a.steps,
            learning_rate=1e-4,
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
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[step_timer(times)],
        )
        for p in model.parameters():  # fp32 adapters, as the service keeps them
            if p.requires_grad:
                p.data = p.data.float()
        res.build_s = time.perf_counter() - t0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        res.notes += "\n" + str(memory)
        res.losses = [round(float(h["loss"]), 5) for h in trainer.state.log_history if "loss" in h]
        if DEVICE == "cuda":
            res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
            res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    n, med = median_after_warmup(times, a.warmup)
    model_f, hw_f = flops_per_token(a.seq)
    res.steps, res.ms_per_step, res.tokens_per_s = n, med * 1e3, a.batch * a.seq / med
    res.mfu = model_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
    res.hfu = hw_f * res.tokens_per_s / (PEAK_TFLOPS * 1e12)
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


def run_dpo_worker(a) -> Result:
    """TRL DPOTrainer on HF + PEFT (baseline, as TRL users run it) vs strop's DPO path, 8B QLoRA.

    4 pairs per step, prompt 512 + completion 512, gradient checkpointing, reference = the base with the
    adapter disabled, TRL's default for a PEFT model (the same for both systems). strop: ``patch_model`` + the chunked DPO loss
    (``strop_dpo_trainer_class``) with fp32 adapters, as the trainer service runs it.
    """
    import tempfile

    import torch
    from trl import DPOConfig, DPOTrainer

    res = Result(part="dpo", system=a.system, seq=1024, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(build_model("qlora", 2048))
    half = 512 if DEVICE == "cuda" else 24  # --smoke: tiny sequences (the CPU runs the kernels interpreted)
    tok, data = dpo_dataset(a.batch * (a.warmup + a.steps), half, half)
    trainer_cls = DPOTrainer
    strop = a.system.startswith("strop")
    if strop:
        from strop.kernels import patch_model
        from strop.kernels.chunked_dpo import strop_dpo_trainer_class

        res.notes = str(patch_model(model))
        trainer_cls = strop_dpo_trainer_class()
    times: list[float] = []

    args = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=a.batch,
        max_steps=a.warmup + a.steps,
        learning_rate=5e-6,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=2 * half,
        logging_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=DEVICE == "cuda",
        use_cpu=DEVICE != "cuda",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = trainer_cls(
        model=model,
        ref_model=None,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[step_timer(times)],
    )
    if strop:
        for p in model.parameters():  # strop keeps adapters fp32 (TRL casts them to bf16 on a 4-bit base)
            if p.requires_grad:
                p.data = p.data.float()
    memory = enable_offload(model, a.system) if offload_spec(a.system) is not None else None
    res.build_s = time.perf_counter() - t0
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if memory is not None:
        res.notes += "\n" + str(memory) + f"\n{memory.offloader!r}"  # after training: what was offloaded
    logs = [h for h in trainer.state.log_history if "loss" in h]
    res.losses = [round(float(h["loss"]), 5) for h in logs]
    res.notes += f"\nmargins: {[round(float(h.get('rewards/margins', 0.0)), 5) for h in logs]}"
    res.steps, med = median_after_warmup(times, a.warmup)
    res.ms_per_step = med * 1e3
    res.tokens_per_s = a.batch / med  # pairs per second for this part
    if DEVICE == "cuda":
        res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
        res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    return res


# ------------------------------------------------------------------------------------------ orchestrator


def spawn(part: str, system: str, seq: int, batch: int, a) -> Result:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
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


def table(results: list[Result]) -> str:
    base = {(r.part, r.seq): r for r in results if r.system == "baseline" and r.ok}
    rows = [
        "| part | system | seq x batch | tokens/s (dpo: pairs/s) | ms/step | peak alloc GiB | peak reserved GiB | host RSS GiB "
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
            f"| {r.part} | {r.system} | {r.seq} x {r.batch} | {r.tokens_per_s:,.0f} | {r.ms_per_step:,.0f} | "
            f"{r.peak_alloc_gib:.1f} | {r.peak_reserved_gib:.1f} | {r.host_peak_rss_gib:.1f} | {r.mfu:.1%} | "
            f"{r.hfu:.1%} | {sp} | {mem} | {', '.join(f'{x:.4f}' for x in r.losses[:3])} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--part", default="qlora")
    p.add_argument("--system", default="baseline")
    p.add_argument("--parts", default="qlora,lora")
    p.add_argument("--systems", default="baseline,strop")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", default="16384,32768,65536,131072,262144")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="also profile one step per system (GPU kernels)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    a = p.parse_args()
    if a.smoke:
        global DEVICE
        DEVICE = "cpu"
        SHAPE.update(SMOKE_SHAPE)
    if a.worker:
        try:
            if a.part == "dpo":
                res = run_dpo_worker(a)
            elif a.system in ("service", "trl-lib"):
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
    results: list[Result] = []
    for part in a.parts.split(","):
        points = [(int(s), 1) for s in a.context.split(",")] if part == "context" else [(a.seq, a.batch)]
        if part == "dpo":
            points = [(1024, 4)]  # 4 pairs of prompt 512 + completion 512 per step
        for system in a.systems.split(","):
            for seq, batch in points:
                r = spawn(part, system, seq, batch, a)
                results.append(r)
                print(
                    f"{part} {system} {seq}x{batch}: "
                    + (f"{r.tokens_per_s:,.0f} tok/s, {r.peak_alloc_gib:.1f} GiB" if r.ok else r.error[:200]),
                    flush=True,
                )
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
