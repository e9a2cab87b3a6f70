"""Step-API benchmark (issue 34): ForwardBackward + OptimStep tokens/s against the jobs path, and 4 runs sharing one
base against 4 separate processes.

Workload: bench/train_bench.py's standard one (the 8B Llama shape saved once as a bf16 dir and loaded with
``from_pretrained``, NF4 double quant for ``--quant qlora``; LoRA r=16 alpha=16 on the seven projections: a run
with ``train_attn``, ``train_mlp``; seq 2048, batch 8; random tokens, seed 0). Every step is one ForwardBackward
(``cross_entropy``, weights 1: the sum over the batch's tokens) and one OptimStep (AdamW lr 1e-4) per run,
through the trainer's core in process (``TrainerCore.runs``: the same futures, worker and kernels as over gRPC,
without the transport).

Parts:
- ``one``: one run; beside it the jobs path, ``train_bench.py``'s ``service`` system (a Train job through the
  trainer service over gRPC) on the same shape, each in its own process. The issue's bar: within 5%.
- ``four``: 4 runs on one session, each driven by its own client thread (the device's worker interleaves them),
  aggregate tokens/s and peak memory; against 4 processes with one run each started together on the same GPU
  (their tokens/s summed, their peak reserved memory summed: each process holds its own copy of the base).

Run on the GPU machine (the lead runs it; figures go to bench/RESULTS.md)::

    python bench/step_bench.py --parts one,four --quant qlora --steps 6 --warmup 2 --json bench/out/step.json

``--smoke`` runs the tiny CPU shape through the same path (fp32; kernels interpreted): it checks the harness.
Each measurement runs in a fresh subprocess (``--worker``) that prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import harness


@dataclass
class StepResult(harness.Result):
    """The harness's result row, plus how many runs shared the trainer."""

    runs: int = 1


def worker(a, w: harness.Workload) -> StepResult:
    import random
    from pathlib import Path

    import torch

    from strop.common import step_types as st
    from strop.common.trainer_types import LoadModelRequest, Quantization
    from strop.trainer_svc.core.trainer_core import TrainerConfig, TrainerCore

    res = StepResult(a.part, a.system, a.seq, a.batch, runs=a.runs)
    work = Path(f"/tmp/strop-step-bench-{os.getpid()}")
    core = TrainerCore(
        TrainerConfig(
            model_root=Path(harness.MODEL_ROOT),
            artifact_root=work / "artifacts",
            state_dir=work / "state",
            device="cuda:0" if w.device == "cuda" else "cpu",
        )
    )
    quant = Quantization.NF4 if a.quant == "qlora" else Quantization.NONE
    sess = core.sessions.load(
        LoadModelRequest(
            model_path=os.path.basename(w.saved_model_dir()),
            quantization=quant,
            dtype=w.dtype,
            max_seq_length=a.seq + 1,
        )
    )
    lora = st.RunLora(rank=16, alpha=16, train_attn=True, train_mlp=True, seed=0)
    runs = [
        core.runs.create(st.CreateTrainingRun(session_id=sess.session_id, lora=lora)) for _ in range(a.runs)
    ]
    rng = random.Random(0)
    vocab = w.shape["vocab"]
    data = []
    for _ in range(a.batch):
        toks = [rng.randrange(vocab) for _ in range(a.seq + 1)]
        data.append(st.Datum.of(toks[:-1], target_tokens=toks[1:], weights=[1.0] * a.seq))
    adam = st.AdamParams(learning_rate=1e-4)

    def one_step(run_id: str, losses: list[float]) -> None:
        fb = core.runs.forward_backward(st.ForwardBackwardRequest(run_id=run_id, data=data))
        opt = core.runs.optim_step(st.OptimStepRequest(run_id=run_id, adam_params=adam))
        for f in (fb, opt):
            out = core.runs.result(f.future_id)
            if out.state is not st.FutureState.SUCCEEDED:
                raise RuntimeError(f"{out.kind.value}: {out.error}")
            if out.forward_backward is not None:
                losses.append(out.forward_backward.metrics[0].value / (a.batch * a.seq))

    def all_runs(losses: list[float]) -> None:
        errors: list[BaseException] = []

        def drive(rid: str) -> None:
            try:
                one_step(rid, losses)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(r.run_id,)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    losses: list[float] = []
    for _ in range(a.warmup):
        all_runs(losses)
    if w.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        all_runs(losses)
        if w.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res.steps = a.steps
    res.ms_per_step = 1000 * sum(times) / len(times)
    res.tokens_per_s = a.runs * a.batch * a.seq * a.steps / sum(times)
    res.losses = [round(x, 5) for x in losses]
    if w.device == "cuda":
        res.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
        res.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    core.runs.stop()
    return res


def worker_cmd(a, runs: int, system: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--part",
        a.part_now,
        "--system",
        system,
        "--runs",
        str(runs),
        "--quant",
        a.quant,
        "--seq",
        str(a.seq),
        "--batch",
        str(a.batch),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        *(["--smoke"] if a.smoke else []),
    ]


def _env(a) -> dict:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    return env


def _parse(proc_out: str, fallback: StepResult) -> StepResult:
    for line in proc_out.splitlines():
        if line.startswith("RESULT "):
            return StepResult(**json.loads(line[7:]))
    fallback.ok, fallback.error = False, proc_out[-1500:]
    return fallback


def spawn(a, runs: int, system: str) -> StepResult:
    proc = subprocess.run(
        worker_cmd(a, runs, system), env=_env(a), capture_output=True, text=True, timeout=a.timeout
    )
    return _parse(proc.stdout + proc.stderr, StepResult(a.part_now, system, a.seq, a.batch, runs=runs))


def spawn_together(a, n: int) -> StepResult:
    """``n`` one-run processes started at once on the same device; tokens/s and peak memory summed."""
    procs = [
        subprocess.Popen(
            worker_cmd(a, 1, "separate"),
            env=_env(a),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(n)
    ]
    outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    parts = [_parse(o, StepResult(a.part_now, "separate", a.seq, a.batch)) for o in outs]
    total = StepResult(a.part_now, f"{n}-processes", a.seq, a.batch, runs=n)
    bad = [p for p in parts if not p.ok]
    if bad:
        total.ok, total.error = False, bad[0].error
        return total
    total.steps = parts[0].steps
    total.tokens_per_s = sum(p.tokens_per_s for p in parts)
    total.ms_per_step = max(p.ms_per_step for p in parts)
    total.peak_alloc_gib = sum(p.peak_alloc_gib for p in parts)
    total.peak_reserved_gib = sum(p.peak_reserved_gib for p in parts)
    return total


def jobs_path(a) -> StepResult:
    """train_bench.py's ``service`` system: a Train job through the trainer service, the same shape."""
    part = "qlora" if a.quant == "qlora" else "lora"
    ns = argparse.Namespace(
        steps=a.steps, warmup=a.warmup, smoke=a.smoke, profile=False, progress="", timeout=a.timeout
    )
    import train_bench  # its service system: a Train job over gRPC

    r = train_bench.spawn(part, "service", a.seq, a.batch, ns)
    return StepResult(**{**asdict(r), "part": a.part_now, "system": "jobs-path"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--parts", default="one,four", help="one: 1 run vs the jobs path; four: 4 runs vs 4 processes"
    )
    p.add_argument(
        "--quant", choices=("qlora", "lora"), default="qlora", help="NF4 base (qlora) or bf16 (lora)"
    )
    p.add_argument("--seq", type=int, help="tokens per datum (default 2048; --smoke 64)")
    p.add_argument("--batch", type=int, help="datums per ForwardBackward (default 8; --smoke 2)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (checks the harness)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="one", help=argparse.SUPPRESS)
    p.add_argument("--system", default="step-api", help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    w = harness.workload("qlora", a.smoke)
    a.seq = a.seq or (64 if a.smoke else 2048)
    a.batch = a.batch or (2 if a.smoke else 8)
    if a.worker:
        try:
            res = worker(a, w)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            res = StepResult(a.part, a.system, a.seq, a.batch, runs=a.runs, ok=False, error=repr(exc)[:300])
        print("RESULT " + json.dumps(asdict(res)), flush=True)
        return
    w.ensure_saved_model(a.seq + 1, "qlora")
    results = []
    for part in a.parts.split(","):
        a.part_now = part
        if part == "one":
            measured = [spawn(a, 1, "step-api"), jobs_path(a)]
        elif part == "four":
            measured = [spawn(a, 4, "step-api-shared-base"), spawn_together(a, 4)]
        else:
            raise SystemExit(f"unknown part {part!r} (one, four)")
        for r in measured:
            line = f"{r.tokens_per_s:,.0f} tokens/s, {r.ms_per_step:.0f} ms/step, peak {r.peak_alloc_gib:.1f} GiB "
            line += f"alloc / {r.peak_reserved_gib:.1f} GiB reserved" if r.ok else r.error[:300]
            print(
                f"{part} {r.system} ({r.runs} run(s), {r.seq}x{r.batch}): {line if r.ok else r.error[:300]}"
            )
            results.append(r)
        if all(r.ok for r in measured) and measured[1].tokens_per_s:
            print(
                f"{part}: step API / {measured[1].system} = {measured[0].tokens_per_s / measured[1].tokens_per_s:.3f}"
            )
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
