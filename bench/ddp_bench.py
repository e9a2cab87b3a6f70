"""One trainer job on N devices through torch.distributed against the same job on one, in the same run.

Each point runs strop's distributed entry point (``python -m strop.trainer_svc.dist_worker``) under torchrun in its
own processes: the standard workload (the 8B Llama shape of ``bench/train_bench.py``, saved once and loaded as a
session loads it; QLoRA NF4 on load or bf16; LoRA r=16 on all seven projections; ``--batch`` rows of ``--seq``
random tokens per device per step; the trainer's default memory mode), for 1 and for ``--devices`` ranks. The
per-device batch is the same at every point (weak scaling), so N ranks train N times the tokens per step.
From rank 0's step events: the median step time after ``--warmup`` steps, the global tokens/s (every rank's rows,
which DDP keeps equal), the scaling efficiency tokens/s(N) / (N · tokens/s(1)) and rank 0's peak device memory.

    python3 bench/ddp_bench.py --devices 2 --json $OUT/ddp.json      # on a node with >= 2 GPUs (NCCL)
    python3 bench/ddp_bench.py --smoke                               # the harness on the CPU: gloo, tiny shape

``--fsdp`` adds a third point: the same ``--devices`` ranks with ``parallelism`` FSDP (FSDP2: the base, NF4 or bf16
as the workload's, sharded over the ranks, its 4-bit codes included). With
``--device-cap-gib G`` every rank of every point may use only G GiB of its GPU
(``torch.cuda.set_per_process_memory_fraction``, set by a ``sitecustomize`` the ranks import), which makes the
base "over one device's budget": pick G under the bf16 base's size (16 GB for the 8B shape) and above its
1/N, and the 1-device and DDP points fail out of memory while the FSDP point trains.

    python3 bench/ddp_bench.py --devices 2 --fsdp --bf16 --device-cap-gib 12 --json $OUT/fsdp.json

``--smoke`` checks the harness (2 gloo ranks on the CPU, the tiny shape, numbers meaningless; with ``--fsdp``, the
FSDP2 point on gloo too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import harness  # the saved model and its shape: one owner

ROOT = Path(__file__).resolve().parents[1]


def _dataset(path: Path, rows: int, seq: int, vocab: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq)]}) + "\n")


def _spec(job_id: str, a, model_path: str, fsdp: bool = False, n: int = 1) -> dict:
    return {
        "job_id": job_id,
        "model": {
            "model_path": model_path,
            "quantization": "NONE" if a.bf16 or a.smoke else "NF4",
            "dtype": "float32" if a.smoke else "bfloat16",
            "max_seq_length": a.seq,
        },
        "lora": {"r": 16, "alpha": 16.0, "seed": 0},
        "config": {
            "method": "SFT",
            "learning_rate": 1e-4,
            "max_steps": a.steps,
            "batch_size": a.batch,
            "max_length": a.seq,
            "lr_scheduler": "constant",
            "seed": 0,
            **({"parallelism": "FSDP", "num_devices": n} if fsdp else {}),
        },
        "dataset_path": "tokens.jsonl",
    }


_CAP = """
import os
import torch
torch.cuda.set_per_process_memory_fraction(
    min(1.0, {gib} * 2**30 / torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory),
    int(os.environ.get("LOCAL_RANK", "0")),
)
"""


def run_point(n: int, a, work: Path, model_root: Path, model_path: str, fsdp: bool = False) -> dict:
    job = f"{'fsdp' if fsdp else 'ddp'}-{n}"
    spec = work / f"{job}.json"
    spec.write_text(json.dumps(_spec(job, a, model_path, fsdp, n)))
    events = work / f"{job}.events"
    worker = [
        "-m",
        "strop.trainer_svc.dist_worker",
        "--spec",
        str(spec),
        "--model-root",
        str(model_root),
        "--artifact-root",
        str(work / "artifacts"),
        "--data-root",
        str(work / "data"),
        "--work-dir",
        str(work / "scratch"),
        "--events",
        str(events),
    ]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RANK", None)
    if a.smoke:
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    if a.device_cap_gib and not a.smoke:
        (work / "cap").mkdir(exist_ok=True)
        (work / "cap" / "sitecustomize.py").write_text(_CAP.format(gib=a.device_cap_gib))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "cap"), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with open(work / f"{job}.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, *launcher, *worker],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=a.timeout,
        )
    wall = time.perf_counter() - t0
    steps = []
    if events.exists():
        for line in events.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("step"):
                steps.append(ev["step"])
    point = {
        "devices": n,
        "parallelism": "FSDP" if fsdp else "DDP" if n > 1 else "-",
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "steps": len(steps),
    }
    timed = [s["step_seconds"] for s in steps[a.warmup :]]
    if proc.returncode != 0 or not timed:
        point["error"] = (work / f"{job}.log").read_text()[-1500:]
        return point
    step_s = statistics.median(timed)
    point.update(
        step_ms=round(1000 * step_s, 1),
        tokens_per_s=round(n * a.batch * a.seq / step_s, 1),
        peak_gib=round(max(s.get("peak_memory_bytes", 0) for s in steps) / 2**30, 2),
        losses=[round(s["loss"], 4) for s in steps[:3]],
    )
    return point


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="ranks of the distributed point (the other is 1)")
    p.add_argument("--seq", type=int, help="tokens per row (default 2048; --smoke: 32)")
    p.add_argument("--batch", type=int, help="rows per device per step (default 8; --smoke: 2)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 LoRA instead of QLoRA (NF4 on load)")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="the harness on the CPU: gloo, tiny shape")
    p.add_argument("--fsdp", action="store_true", help="add the FSDP2 point (--devices ranks, the same base)")
    p.add_argument("--device-cap-gib", type=float, default=0.0, help="GPU memory each rank may use (0: all)")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.warmup = min(a.steps, 4), min(a.warmup, 1)
    a.seq = a.seq or (32 if a.smoke else 2048)
    a.batch = a.batch or (2 if a.smoke else 8)
    w = harness.workload("qlora", a.smoke)  # the standard workload's Llama shape (--smoke: the tiny one)
    w.ensure_saved_model(a.seq, "qlora")
    model_dir = Path(w.saved_model_dir())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        _dataset(work / "data" / "tokens.jsonl", a.devices * a.batch * (a.steps + 1), a.seq, vocab)
        points = [run_point(n, a, work, model_dir.parent, model_dir.name) for n in (1, a.devices)]
        if a.fsdp:
            points.append(run_point(a.devices, a, work, model_dir.parent, model_dir.name, fsdp=True))
    one = points[0].get("tokens_per_s")
    for pt in points[1:]:
        if one and pt.get("tokens_per_s"):
            pt["efficiency"] = round(pt["tokens_per_s"] / (pt["devices"] * one), 3)
    what = "fp32 LoRA (tiny shape)" if a.smoke else "bf16 LoRA" if a.bf16 else "QLoRA"
    print(
        f"{what}, {a.batch} x {a.seq} tokens per device per step, {'smoke (CPU, gloo)' if a.smoke else 'CUDA, NCCL'}"
    )
    print(
        "| devices | parallelism | tokens/s | ms/step | scaling efficiency | rank 0 peak GiB | first losses | rc |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---:|")
    for pt in points:
        print(
            f"| {pt['devices']} | {pt['parallelism']} | {pt.get('tokens_per_s', '-')} | {pt.get('step_ms', '-')} | "
            f"{pt.get('efficiency', '-')} | {pt.get('peak_gib', '-')} | {pt.get('losses', '-')} | {pt['rc']} |"
        )
    for pt in points:
        if "error" in pt:
            print(f"\n## {pt['devices']} devices ({pt['parallelism']}) failed\n{pt['error']}")
    if a.json:
        Path(a.json).write_text(json.dumps(points, indent=1))
    return 0 if all(pt["rc"] == 0 and "error" not in pt for pt in points) else 1


if __name__ == "__main__":
    sys.exit(main())
