"""Sampling benchmark (issue 34): strop's sampler vs transformers' ``generate`` on the same PEFT model, each in its
own process.

Workload: 64 prompts (ragged, 64..128 random tokens, left-padded by both systems) x 512 new tokens each, sampled
at temperature 1 with no top-k/top-p and no stop token (every row makes all 512 tokens), on the 8B Llama shape
of ``bench/train_bench.py`` (its saved random model, loaded with from_pretrained and BitsAndBytesConfig NF4 double
quant, bf16 compute: DESIGN.md's baseline recipe), LoRA r=16 alpha=16 on all seven projections with B drawn
N(0, 0.01²) from seed 0 (so the adapter changes every logit; the same for both systems).

Systems:
  ``hf``     ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1, min_new_tokens=max_new_tokens=512)``
             with a left-padded attention mask, SDPA, the default dynamic cache; no per-token scores returned
             (returning them would cost it 64 x 128,256 fp32 logits per step).
  ``strop``  ``strop.trainer_svc.core.sampler.sample`` on the same model patched by ``patch_model`` (as the trainer
             service sessions on CUDA are), with per-token log-probs; variants in the same process: ``full`` (the
             sampler's defaults: CUDA graph, the model's own projections), ``nf4`` (CUDA graph + the opt-in fused
             NF4 decode kernel), ``no-nf4`` (explicitly off), ``eager`` (defaults, no graph);
             ``--variants nf4|no-nf4,eager`` runs no-nf4 only if nf4 failed.
Each system first runs a warm-up call of 8 new tokens; the timed call is one call (prefill, graph capture and all
512 steps). tokens/s = new tokens / wall time of the call. The strop worker also teacher-forces two sampled
sequences through the model's ordinary forward (unpatched: PEFT + bitsandbytes, no cache) and reports the largest
difference between those log-probs and the sampler's (the sampler's correctness on this GPU, at bf16).

Usage (GPU machine, after ``source bench/gpu_env.sh``)::

    python bench/sample_bench.py                       # both systems, table
    python bench/sample_bench.py --smoke               # tiny shape on the CPU: checks the harness, not speed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import harness  # the saved 8B shape and the baseline's loading recipe

PROMPTS = 64
NEW_TOKENS = 512
PROMPT_MIN, PROMPT_MAX = 64, 128


@dataclass
class Row:
    system: str
    variant: str
    ok: bool = True
    error: str = ""
    new_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    ms_per_step: float = 0.0
    prefill_s: float = 0.0
    peak_alloc_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    cuda_graph: bool = False
    nf4_layers: int = 0
    max_abs_logprob_diff: float = -1.0
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    build_s: float = 0.0


def prompts(n: int, vocab: int, lo: int, hi: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (lo + (i * 37) % (hi - lo + 1),), generator=g).tolist() for i in range(n)]


def build_model(w: harness.Workload, patch: bool):
    import torch

    model = harness.attach_lora(w.load_model(qlora=True))
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
    notes = ""
    if patch:
        from strop.kernels.models import patch_model

        notes = str(patch_model(model)).splitlines()[0]
    model.eval()
    return model, notes


def reset_peak(w: harness.Workload):
    import torch

    if w.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(w: harness.Workload, row: Row):
    import torch

    if w.device == "cuda":
        row.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
        row.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30


def run_hf(a, w: harness.Workload) -> Report:
    import torch

    t0 = time.perf_counter()
    model, _ = build_model(w, patch=False)
    rep = Report(build_s=time.perf_counter() - t0)
    ps = prompts(a.prompts, w.shape["vocab"], a.prompt_min, a.prompt_max)
    width = max(map(len, ps))
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros(len(ps), width, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    dev = "cuda" if w.device == "cuda" else "cpu"
    ids, mask = ids.to(dev), mask.to(dev)

    def gen(n: int):
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                use_cache=True,
            )

    torch.manual_seed(0)
    gen(8)
    row = Row("hf", "generate")
    reset_peak(w)
    w.sync()
    ts = time.perf_counter()
    out = gen(a.new_tokens)
    w.sync()
    row.seconds = time.perf_counter() - ts
    peak(w, row)
    row.new_tokens = int((out.shape[1] - width) * out.shape[0])
    row.tokens_per_s = row.new_tokens / row.seconds
    row.ms_per_step = row.seconds / a.new_tokens * 1e3
    rep.rows.append(row)
    return rep


def run_strop(a, w: harness.Workload) -> Report:
    import torch

    from strop.trainer_svc.core.sampler import SampleRequest, SampleStats, SamplingParams, sample

    t0 = time.perf_counter()
    model, notes = build_model(w, patch=w.device == "cuda")
    rep = Report(build_s=time.perf_counter() - t0)
    ps = prompts(a.prompts, w.shape["vocab"], a.prompt_min, a.prompt_max)
    variants = {
        "full": {},
        "nf4": {"nf4_decode": True},
        "no-nf4": {"nf4_decode": False},
        "eager": {"cuda_graphs": False},
    }
    names = [alt for group in a.variants.split(",") for alt in group.split("|")]
    checks = []
    for name in names:
        group = next(g.split("|") for g in a.variants.split(",") if name in g.split("|"))
        earlier = group[: group.index(name)]
        if earlier and any(r.ok for r in rep.rows if r.variant in earlier):
            continue  # "a|b": b only if a failed
        kw = variants[name]
        row = Row("strop", name, note=notes)
        try:
            warm = [SampleRequest(p, 1, SamplingParams(max_tokens=8, seed=i)) for i, p in enumerate(ps)]
            sample(model, warm, **kw)
            reqs = [
                SampleRequest(p, 1, SamplingParams(max_tokens=a.new_tokens, seed=i)) for i, p in enumerate(ps)
            ]
            stats = SampleStats()
            reset_peak(w)
            w.sync()
            ts = time.perf_counter()
            res = sample(model, reqs, stats=stats, **kw)
            w.sync()
            row.seconds = time.perf_counter() - ts
            peak(w, row)
            row.new_tokens = sum(len(s.tokens) for r in res for s in r.sequences)
            row.tokens_per_s = row.new_tokens / row.seconds
            row.ms_per_step = stats.decode_s / max(1, stats.steps) * 1e3
            row.prefill_s = stats.prefill_s
            row.cuda_graph = stats.cuda_graph
            row.nf4_layers = int(stats.extra.get("nf4_decode_layers", 0))
            row.note = (row.note + " " + stats.note).strip()
            checks.append((row, res))
        except Exception as exc:  # recorded, the other variants still run
            import traceback

            traceback.print_exc()
            row.ok, row.error = False, repr(exc)[:400]
        rep.rows.append(row)
        torch.cuda.empty_cache() if w.device == "cuda" else None
    # the reference forward on HF + PEFT + bitsandbytes (no kernel compiles for new shapes on the clock)
    if w.device == "cuda":
        from strop.kernels.models import unpatch_model

        unpatch_model(model)
    for row, res in checks:
        row.max_abs_logprob_diff = logprob_check(model, ps, res)
    return rep


def logprob_check(model, ps, res, n: int = 2) -> float:
    """Largest |sampler log-prob - teacher-forced log-prob| over ``n`` sampled sequences (no cache, PEFT path)."""
    import torch

    dev = next(model.parameters()).device
    worst = 0.0
    for p, r in list(zip(ps, res, strict=True))[:n]:
        s = r.sequences[0]
        seq = torch.tensor([p + s.tokens], device=dev)
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, seq[0, len(p) :, None])[:, 0]
        worst = max(worst, float((lp.cpu() - torch.tensor(s.logprobs)).abs().max()))
    return worst


def spawn(system: str, a) -> Report:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        system,
        "--variants",
        a.variants,
        "--prompts",
        str(a.prompts),
        "--new-tokens",
        str(a.new_tokens),
        "--prompt-min",
        str(a.prompt_min),
        "--prompt-max",
        str(a.prompt_max),
        *(["--smoke"] if a.smoke else []),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return Report([Row(system, "-", ok=False, error=f"timeout after {a.timeout}s")])
    if a.show_stderr and proc.stderr:
        print(f"--- {system} worker stderr (tail) ---\n{proc.stderr[-a.show_stderr :]}", flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            d = json.loads(line[7:])
            return Report([Row(**r) for r in d["rows"]], d["build_s"])
    return Report(
        [Row(system, "-", ok=False, error=f"rc={proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")]
    )


def table(reports: list[Report], a) -> str:
    base = next((r for rep in reports for r in rep.rows if r.system == "hf" and r.ok), None)
    lines = [
        f"{a.prompts} prompts x {a.new_tokens} new tokens, 8B-shape QLoRA"
        if not a.smoke
        else "smoke (tiny shape, CPU): harness only",
        "| system | variant | new tokens | s | tokens/s | vs hf | ms/step | prefill s | peak alloc GiB | "
        "reserved GiB | graph | NF4 layers | max |Δ logprob| | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rep in reports:
        for r in rep.rows:
            if not r.ok:
                lines.append(f"| {r.system} | {r.variant} | failed: {r.error[:300]} |")
                continue
            ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
            lp = f"{r.max_abs_logprob_diff:.4f}" if r.max_abs_logprob_diff >= 0 else "-"
            lines.append(
                f"| {r.system} | {r.variant} | {r.new_tokens} | {r.seconds:.2f} | {r.tokens_per_s:,.0f} | {ratio} | "
                f"{r.ms_per_step:.1f} | {r.prefill_s:.2f} | {r.peak_alloc_gib:.1f} | {r.peak_reserved_gib:.1f} | "
                f"{r.cuda_graph} | {r.nf4_layers} | {lp} | {r.note[:120]} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["hf", "strop"])
    p.add_argument("--systems", default="hf,strop")
    p.add_argument("--variants", default="full,nf4")
    p.add_argument("--prompts", type=int, default=PROMPTS)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--prompt-min", type=int, default=PROMPT_MIN)
    p.add_argument("--prompt-max", type=int, default=PROMPT_MAX)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    p.add_argument(
        "--show-stderr", type=int, default=0, metavar="CHARS", help="print the tail of each worker's stderr"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    a = p.parse_args()
    w = harness.workload("qlora", a.smoke)
    if a.worker:
        try:
            rep = run_hf(a, w) if a.worker == "hf" else run_strop(a, w)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            rep = Report([Row(a.worker, "-", ok=False, error=repr(exc)[:400])])
        print("RESULT " + json.dumps(asdict(rep)), flush=True)
        return
    t0 = time.perf_counter()
    w.ensure_saved_model(harness.MAX_POSITIONS, "qlora")
    print(f"saved model ready in {time.perf_counter() - t0:.0f} s", flush=True)
    reports = []
    for system in a.systems.split(","):
        rep = spawn(system, a)
        reports.append(rep)
        for r in rep.rows:
            print(
                f"{system} {r.variant}: " + (f"{r.tokens_per_s:,.0f} tok/s" if r.ok else r.error[:300]),
                flush=True,
            )
        print(f"{system} build {rep.build_s:.0f} s", flush=True)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=1)
    print(table(reports, a))


if __name__ == "__main__":
    main()
