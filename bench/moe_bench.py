"""MoE training benchmark: a Qwen3-30B-A3B shape with random weights, HF + PEFT vs strop, each in its own process.

Shape (Qwen3-30B-A3B's config): hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128 experts of intermediate
768 with 8 per token (top-k renormalized), vocab 151,936, untied head; the load-balancing loss off as released
(``output_router_logits`` false). LoRA r=16 alpha=16 on q/k/v/o and on every expert's gate/up/down (PEFT
``target_parameters`` on the fused expert parameters: what the trainer attaches, ``trainer_svc/core/moe.py``),
adapters fp32, bf16 autocast, gradient checkpointing (use_reentrant=False), torch.optim.AdamW(lr=1e-4),
PYTORCH_ALLOC_CONF=expandable_segments:True, the same random tokens and seed for every system.

QLoRA for the baseline is what bitsandbytes gives an MoE: its 4-bit quantization covers ``nn.Linear`` layers only,
so the attention projections are NF4 (double quant, bf16 compute) and the experts stay bf16 (~57 GiB of the model's
~61). The ``strop`` system is strop's kernels on attention, norms and loss with the experts on the grouped expert GEMM
(``kernels/ops/moe_gemm.py``: torch's grouped GEMM for the base and the LoRA terms, no merged stack) and, under
QLoRA, the experts held in strop's NF4 storage as the trainer holds them in a 4-bit session
(``kernels/models/moe_experts.quantize_experts``, each stack dequantized into one shared buffer just before its
GEMM); ``--no-nf4-experts`` keeps them bf16. The baseline's experts run what ``from_config`` resolves for a Qwen3-MoE
(transformers' ``grouped_mm`` experts).

Deviation from DESIGN's baseline recipe, and why: the model is built in GPU memory (``from_config`` under bf16)
and its attention quantized to NF4 by hand with bitsandbytes' own ``Linear4bit``/``Params4bit``, instead of saved
and reloaded with ``from_pretrained``: the bf16 checkpoint is ~61 GB and the one-GPU machine's disk is 64 GiB.
Both systems load the same way, so the comparison holds; the dense 8B case measured a built-in-memory model 11%
slower than a reloaded one (DESIGN), so absolute tokens/s may read low.

Usage (on the GPU machine)::

    python bench/moe_bench.py --systems baseline,strop --batch 8 --seq 2048 --steps 4 --json bench/out/moe.json
    python bench/moe_bench.py --systems baseline,strop --batch 1 --seq 2048 --steps 3    # peak memory at 1 x 2048
    python bench/moe_bench.py --systems strop --batch 1 --seq 2048 --steps 3 --host-adam  # AdamW's moments on the host
    python bench/moe_bench.py --find-longest --host-adam --memory-mode long_context --budget 540  # longest, batch 1
    python bench/moe_bench.py --smoke                                                     # CPU: the harness only

``--host-adam``: the optimizer is ``kernels/models/host_adamw.HostAdamW`` (torch's AdamW bit for bit, its moments in
pinned host memory streamed through the device; what the trainer's admission picks when the moments would not fit).

``--memory-mode standard|long_context``: strop's system with the trainer's memory mode installed (``apply_memory_mode``:
layer inputs in host memory; long_context also the MLP over sequence chunks where it applies); the default ``none`` is HF's gradient checkpointing alone, as the figures before.
``--features save_qkv=0,save_attention=0``: that mode with some of its ``MemoryFeatures`` replaced (0/1 for flags), to
measure what each feature adds on this step (a variant, not a mode a job runs).

``--find-longest`` (strop alone, batch 1): the longest sequence whose training step (``--warmup`` + ``--steps``)
runs without running out of device memory, by bench/lib/longest.py's search (doubling from ``--find-start``, then
bisection to ``--find-step``; one fresh worker per trial, each trial's row printed as it ends; no trial starts past
``--budget`` seconds, and a stopped search prints the flags to continue from).

Each system runs in a fresh subprocess (``--worker``) printing one ``RESULT {json}`` line; peak memory is reset
after loading and setup, so it is the training steps' (plus the weights, reported beside it), and is also given by
phase: forward + backward, and the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# bench/ on sys.path, also under ``python -P``: the search is bench/lib's
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import longest

SYSTEMS = ("baseline", "strop")


@dataclass
class Result:
    system: str
    batch: int
    seq: int
    layers: int
    tokens_per_s: float = 0.0
    ms_per_step: float = 0.0
    weights_gib: float = 0.0
    peak_allocated_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    peak_fwd_bwd_gib: float = 0.0  # the peak's two phases: forward + backward, and the optimizer step
    peak_optimizer_gib: float = 0.0
    device_gib: float = 0.0  # the device's total memory
    losses: list | None = None
    profile: str = ""
    error: str = ""
    oom: bool = False  # failed by running out of device memory
    wall_s: float = 0.0  # the worker's wall time, model building included
    merge_tiles: str = ""  # strop on CUDA: the expert-stack merge's tile the autotuner kept, by stack shape
    step_ms: list | None = None  # each measured step's time, in order


def shape(layers: int, smoke: bool) -> dict:
    if smoke:
        return dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
        )
    return dict(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
    )


def build_model(a, device: str):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **shape(a.layers, a.smoke),
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        max_position_embeddings=max(40_960, a.seq),  # RoPE's default type never reads it: longer runs as well
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    )
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if a.smoke else torch.bfloat16
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    if a.qlora:
        quantize_attention_nf4(model, dtype, device)
        if a.system == "strop" and a.nf4_experts:
            from strop.kernels.models.moe_experts import quantize_experts

            quantize_experts(model)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    model.config.use_cache = False
    return model


def quantize_attention_nf4(model, compute_dtype, device: str) -> None:
    """What ``BitsAndBytesConfig(load_in_4bit, nf4, double quant)`` does to this model: every ``nn.Linear`` but the
    head becomes a ``Linear4bit`` (here: the attention projections; the experts are not ``nn.Linear``)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(attn, name)
            q = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            q.bias = lin.bias
            # Params4bit quantizes on its move to the device, as transformers' loader has it do
            w = lin.weight.detach().to("cpu")
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
            q = q.to(device)
            setattr(attn, name, q)
            del lin
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attach_lora(model):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    model = get_peft_model(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def feature_overrides(text: str) -> dict:
    """``save_qkv=0,save_attention=0`` as MemoryFeatures fields: 0/1 for flags, numbers for the rest."""
    import dataclasses

    from strop.common.memory_modes import MemoryFeatures

    types = {f.name: f.type for f in dataclasses.fields(MemoryFeatures)}
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"--features: no MemoryFeatures field {name!r} (fields: {', '.join(types)})")
        kind = str(types[name])
        out[name] = (
            bool(int(value)) if kind.startswith("bool") else float(value) if "float" in kind else int(value)
        )
    return out


def tune_offload(model, text: str) -> str:
    """``keep_last=6``: how many of the last checkpointed layers keep their input on the device (recomputing
    attention), set after the mode installed it (an experiment's knob, not a mode's)."""
    from strop.kernels.models.hf import unwrap_peft

    state = unwrap_peft(model).__dict__.get("_strop_offload")
    if state is None:
        raise SystemExit("--offload: the memory mode installed no offload")
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name != "keep_last":
            raise SystemExit(f"--offload: {name!r} is not keep_last")
        state.keep_last = int(value)
        state.apply()
    return f"offload tuned: {text}"


def run_worker(a) -> Result:
    import torch

    device = "cpu" if a.smoke else "cuda"
    res = Result(a.system, a.batch, a.seq, a.layers)
    model = attach_lora(build_model(a, device))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if a.system == "strop":
        from strop.kernels.models import patch_model

        print(patch_model(model), file=sys.stderr)
        if a.memory_mode != "none":  # the trainer's memory mode, installed as a job installs it
            from strop.common.memory_modes import MemoryMode
            from strop.kernels.models import StepShape, apply_memory_mode

            smoke = {} if device == "cuda" else {"offload_cpu_tensors": True, "min_offload_bytes": 0}
            mode = MemoryMode(a.memory_mode)
            if a.features:
                import dataclasses

                from strop.common.memory_modes import MEMORY_MODES

                mode = dataclasses.replace(MEMORY_MODES[mode], **feature_overrides(a.features))
            installed = apply_memory_mode(model, mode, step=StepShape(a.batch, a.seq), device=device, **smoke)
            print(installed, file=sys.stderr)
            if a.offload:
                print(tune_offload(model, a.offload), file=sys.stderr)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if a.host_adam:
        from strop.kernels.models.host_adamw import HostAdamW

        opt = HostAdamW(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=gen).to(device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        res.weights_gib = torch.cuda.memory_allocated() / 2**30
        res.device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    peaks = {"fwd_bwd": 0, "optimizer": 0, "reserved": 0}

    def phase_peak(phase: str) -> None:
        """The allocator's peak since the last call is ``phase``'s (its counters are host-side: no sync needed)."""
        if cuda:
            peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated())
            peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not a.smoke):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        phase_peak("fwd_bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase_peak("optimizer")
        if cuda:
            torch.cuda.synchronize()
        losses.append(float(loss))
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    res.losses = losses
    res.step_ms = [round(1000 * t, 1) for t in times]
    res.ms_per_step = 1000 * sum(times) / len(times)
    res.tokens_per_s = a.batch * a.seq / (res.ms_per_step / 1000)
    if cuda:
        res.peak_fwd_bwd_gib, res.peak_optimizer_gib = peaks["fwd_bwd"] / 2**30, peaks["optimizer"] / 2**30
        res.peak_allocated_gib = max(res.peak_fwd_bwd_gib, res.peak_optimizer_gib)
        res.peak_reserved_gib = peaks["reserved"] / 2**30
    if a.system == "strop" and cuda:
        res.merge_tiles = kept_merge_tiles()
    if a.profile and cuda:  # one more step, after the timed ones and their peak
        res.profile = profile_moe_step(model, opt, ids)
    return res


def kept_merge_tiles() -> str:
    """The merge kernel's kept tile for each stack shape: BLOCK_N x BLOCK_K x warps, and how a byte's codes are
    read (the 2 KiB pair table or the 16-entry code book)."""
    from strop.kernels.ops import moe_gemm

    return " ".join(
        f"[{key[1]}, {key[2]}]: {t['BLOCK_N']}x{t['BLOCK_K']}x{t['num_warps']}/{'pairs' if t.get('PAIRS') else 'book'}"
        f"{'/' + str(t['K_TILES']) + ' tiles' if t.get('K_TILES', 1) > 1 else ''}"
        for key, t in moe_gemm._MERGE_TILE.items()
    )


def profile_moe_step(model, opt, ids) -> str:
    """One training step under the profiler (bench/lib/profile.py), its forward, backward and optimizer step
    labelled as phases, the kernels grouped into the MoE step's kinds (``MOE_KERNEL_KINDS`` there); then one more
    step's host waits for the GPU (``sync_sites``)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/lib, also under ``python -P``
    from lib.profile import KERNEL_KINDS, MOE_KERNEL_KINDS, profile_step, sync_sites

    def step():
        with torch.profiler.record_function("phase:forward"), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.record_function("phase:backward"):
            loss.backward()
        with torch.profiler.record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    return profile_step(step, kinds=MOE_KERNEL_KINDS + KERNEL_KINDS) + "\n" + sync_sites(step)


def spawn(system: str, a, timeout: float | None = None) -> Result:
    timeout = a.timeout if timeout is None else timeout
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--system",
        system,
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--layers",
        str(a.layers),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
    ]
    cmd += ["--smoke"] * a.smoke + ["--no-qlora"] * (not a.qlora) + ["--no-nf4-experts"] * (not a.nf4_experts)
    cmd += ["--profile"] * a.profile + ["--host-adam"] * a.host_adam + ["--memory-mode", a.memory_mode]
    cmd += ["--features", a.features] * bool(a.features) + ["--offload", a.offload] * bool(a.offload)
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        wall = time.perf_counter() - t0
        return Result(system, a.batch, a.seq, a.layers, error=f"timed out after {timeout:.0f} s", wall_s=wall)
    wall = time.perf_counter() - t0
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (out.stderr or out.stdout)[-2000:]
        return Result(system, a.batch, a.seq, a.layers, error=tail, oom=longest.is_oom(tail), wall_s=wall)
    return Result(**{**json.loads(line.removeprefix("RESULT ")), "wall_s": wall})


def find_longest(a) -> dict:
    """The longest sequence at batch 1 strop's step runs without running out of device memory
    (bench/lib/longest.py's search, one fresh worker a trial); prints each trial's row, then the result."""
    print(
        f"longest sequence at batch 1, Qwen3-30B-A3B shape, {a.layers} layers, strop, memory mode {a.memory_mode}, "
        "AdamW moments " + ("in host memory (HostAdamW)" if a.host_adam else "on the device"),
        "\n| seq | result | peak alloc GiB | peak reserved GiB | weights GiB | ms/step | tok/s | trial s |"
        "\n|---|---|---|---|---|---|---|---|",
        flush=True,
    )

    def trial(n: int, left: float) -> longest.Trial:
        r = spawn(
            "strop", argparse.Namespace(**{**vars(a), "batch": 1, "seq": n}), timeout=min(a.timeout, left)
        )
        outcome = longest.FITS if not r.error else longest.OOM if r.oom else longest.ERROR
        note = "" if outcome != longest.ERROR else ": " + r.error.strip().splitlines()[-1][-200:]
        print(
            f"| {n:,} | {outcome}{note} | {r.peak_allocated_gib:.2f} | {r.peak_reserved_gib:.2f} | "
            f"{r.weights_gib:.2f} | {r.ms_per_step:,.0f} | {r.tokens_per_s:,.0f} | {r.wall_s:.0f} |",
            flush=True,
        )
        return longest.Trial(outcome, r.wall_s, r)

    s = longest.find_longest_from_flags(trial, a)
    print(
        f"longest that fits at batch 1: {s.fits:,} tokens; {s.summary()}; continue with "
        f"{s.continue_flags(a.find_start)}",
        flush=True,
    )
    fit = [(n, t.row.peak_reserved_gib) for n, t in s.trials if t.outcome == longest.FITS]
    device = max((t.row.device_gib for _, t in s.trials), default=0.0)
    line = longest.extrapolated(fit, device) if device else None
    if line is not None:
        print(
            f"derived, not measured: the peak reserved grows {line[0] * 2**20:.1f} KiB a token between the two longest "
            f"that fit; a straight line reaches the device's {device:.1f} GiB at ~{line[1]:,} tokens",
            flush=True,
        )
    return s.as_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--system", default="baseline", choices=SYSTEMS)
    p.add_argument("--systems", default="baseline,strop")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=48, help="decoder layers (48: Qwen3-30B-A3B)")
    p.add_argument("--steps", type=int, default=4)
    # two: a process started right after another MoE process (a device call's second) ran its second step ~25%
    # slow, the steps after it as the first process's (bench/RESULTS.md, session 37)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-qlora", dest="qlora", action="store_false", help="bf16 LoRA: no NF4 attention")
    p.add_argument(
        "--no-nf4-experts",
        dest="nf4_experts",
        action="store_false",
        help="strop under QLoRA: keep the experts bf16 instead of strop's NF4 expert storage",
    )
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument(
        "--host-adam",
        action="store_true",
        help="AdamW's moments in pinned host memory (HostAdamW, bit for bit torch's AdamW)",
    )
    p.add_argument(
        "--memory-mode",
        default="none",
        choices=["none", "standard", "long_context"],
        help="strop: install the trainer's memory mode (none: HF's gradient checkpointing alone, as before)",
    )
    p.add_argument(
        "--features",
        default="",
        help="with --memory-mode: replace some of the mode's MemoryFeatures, e.g. save_qkv=0,save_attention=0",
    )
    p.add_argument("--offload", default="", help="with --memory-mode: keep_last=K (an experiment)")
    longest.add_flags(p, unit="sequence tokens at batch 1", start=16384, max_length=262_144)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one step per system after the timed ones (CUDA): top kernels, GPU time by kind, idle",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    p.add_argument("--json")
    a = p.parse_args()
    if (
        a.smoke and not a.worker
    ):  # the parent's tiny shape; a worker (a --find-longest trial) takes what it is given
        a.batch, a.seq, a.layers, a.steps, a.warmup = 2, 32, 2, 2, 0
    if a.worker:
        try:
            res = run_worker(a)
        except Exception as exc:  # the parent reads the failure (out of memory or not) from the result line
            import traceback

            traceback.print_exc()
            res = Result(a.system, a.batch, a.seq, a.layers, error=repr(exc)[-400:], oom=longest.is_oom(exc))
        print("RESULT " + json.dumps(asdict(res)), flush=True)
        return
    if a.find_longest:
        found = find_longest(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(found, f, indent=1)
        return
    results = [spawn(s, a) for s in a.systems.split(",")]
    quant = (
        ("QLoRA (NF4 attention; strop's experts " + ("NF4)" if a.nf4_experts else "bf16)"))
        if a.qlora
        else "bf16 LoRA"
    )
    moments = "AdamW's moments " + ("in host memory (HostAdamW)" if a.host_adam else "on the device")
    print(
        f"Qwen3-30B-A3B shape, {a.layers} layers, {quant}, {a.batch} x {a.seq}, {moments}, strop's memory mode "
        f"{a.memory_mode}"
        + (f" ({a.features})" if a.features else "")
        + (f" (offload {a.offload})" if a.offload else "")
    )
    print(
        "system     tok/s    ms/step  weights GiB  peak alloc GiB  peak reserved GiB  fwd+bwd / optimizer peak  losses"
    )
    for r in results:
        if r.error:
            print(f"{r.system:9}  failed: {r.error.splitlines()[-1] if r.error else ''}")
            continue
        print(
            f"{r.system:9} {r.tokens_per_s:7.0f} {r.ms_per_step:9.1f} {r.weights_gib:11.2f} "
            f"{r.peak_allocated_gib:15.2f} {r.peak_reserved_gib:18.2f} "
            f"{r.peak_fwd_bwd_gib:13.2f} / {r.peak_optimizer_gib:<9.2f}  {[round(x, 4) for x in r.losses]}"
        )
    for r in results:
        if r.step_ms:
            print(f"{r.system}: measured steps {r.step_ms} ms")
    for r in results:
        if r.merge_tiles:
            print(f"{r.system}: the expert-stack merge kept {r.merge_tiles}")
    for r in results:
        if r.profile:
            print(f"\n## {r.system} {a.batch}x{a.seq}\n{r.profile}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
