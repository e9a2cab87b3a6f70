"""The Tinker gateway's overhead (issue 35): one RL loop through the official tinker SDK and the gateway, against the
same loop through strop's gRPC SDK (``TrainingRun``), each against a fresh trainer process on the same GPU.

Workload: bench/train_bench.py's 8B Llama shape (random weights, saved once; NF4 double quant with ``--quant qlora``),
a LoRA run of rank 16 (attention and MLP; alpha strop's default, 32, in both systems). Each step is the loop an RL
recipe runs (tinker-cookbook's ``rl`` loop, minus its environment): snapshot the weights for sampling; sample a group
of ``--group`` completions of ``--max-tokens`` for each of ``--prompts`` random prompts of ``--prompt-len`` tokens
(temperature 1, seeded, all prompts submitted at once); score them with a verifiable reward (the share of even token
ids in the completion); group-relative advantages; one ``importance_sampling`` forward_backward over every
completion (prompt positions advantage 0), one optim_step (Adam, lr 1e-5). The trainer, the gateway (for
``tinker``) and the driver (this process) are separate processes, as deployed.

Reported per system over the measured steps: sampled tokens/s (completion tokens / sampling time), trained tokens/s
(forward_backward tokens / forward_backward + optim_step time), step time, mean reward, and the GPU's peak memory
in use (``nvidia-smi``, sampled twice a second). The issue's bar: the gateway's step time within 5% of the gRPC
SDK's.

Run on the GPU machine (the lead runs it; figures go to bench/RESULTS.md)::

    python bench/gateway_bench.py --quant qlora --steps 4 --warmup 1 --json bench/out/gateway.json

``--smoke`` runs the tiny CPU shape through the same processes (fp32; kernels interpreted): it checks the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import harness

KEY = "tml-gateway-bench"  # the trainer runs without authentication: every key is the one local tenant


@dataclass
class LoopResult:
    system: str
    ok: bool = True
    error: str = ""
    steps: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    sample_s: float = 0.0
    train_s: float = 0.0
    step_s: float = 0.0
    sampled_tokens_per_s: float = 0.0
    trained_tokens_per_s: float = 0.0
    peak_gpu_mib: float = 0.0
    rewards: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuPeak:
    """The GPU's memory in use, sampled by nvidia-smi twice a second; ``peak`` in MiB (0 without nvidia-smi)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0.0, threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True) if shutil.which("nvidia-smi") else None

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0 and out.stdout.strip():
                self.peak = max(self.peak, float(out.stdout.split()[0]))

    def __enter__(self) -> GpuPeak:
        if self._t:
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


class Processes:
    """The trainer (and the gateway) as child processes, ended on exit."""

    def __init__(self, a, work: str):
        self.a, self.work, self.procs = a, work, []
        self.env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True", "HF_HUB_OFFLINE": "1"}
        if a.smoke:
            self.env["TRITON_INTERPRET"] = "1"

    def start(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.work, f"{name}.log"), "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def trainer(self) -> str:
        port_file = os.path.join(self.work, "trainer.port")
        p = self.start(
            [
                sys.executable,
                "-m",
                "strop.trainer_svc",
                "--address",
                "127.0.0.1:0",
                "--port-file",
                port_file,
                "--model-root",
                harness.MODEL_ROOT,
                "--artifact-root",
                os.path.join(self.work, "artifacts"),
                "--state-dir",
                os.path.join(self.work, "state"),
                "--device",
                "cpu" if self.a.smoke else "cuda:0",
            ],
            "trainer",
        )
        deadline = time.monotonic() + 300
        while not os.path.exists(port_file):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not start (log {self.work}/trainer.log)")
            time.sleep(0.2)
        return f"127.0.0.1:{open(port_file).read().strip()}"

    def gateway(self, trainer: str) -> str:
        port, health = free_port(), free_port()
        p = self.start(
            [
                sys.executable,
                "-m",
                "strop.gateways.tinker",
                "--listen",
                f"127.0.0.1:{port}",
                "--trainer",
                trainer,
                "--model-root",
                harness.MODEL_ROOT,
                "--quantization",
                self.a.quantization,
                "--dtype",
                self.a.dtype,
                "--max-seq-length",
                str(self.a.max_seq),
                "--health-port",
                str(health),
            ],
            "gateway",
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return f"http://127.0.0.1:{port}"
            except OSError:
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not get ready (log {self.work}/gateway.log)")
            time.sleep(0.2)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


class GrpcLoop:
    """The loop through strop's gRPC SDK: a TrainingRun on a session of the base."""

    def __init__(self, trainer: str, a):
        from strop.client import TrainerClient
        from strop.common import step_types as st
        from strop.common.trainer_types import Quantization

        self.st, self.a = st, a
        self.tc = TrainerClient(trainer)
        sess = self.tc.load_model(
            a.base, quantization=Quantization(a.quantization), dtype=a.dtype, max_seq_length=a.max_seq
        )
        lora = st.RunLora(rank=16, train_attn=True, train_mlp=True, train_unembed=False, seed=0)
        self.run = self.tc.create_training_run(sess.session_id, lora)

    def snapshot(self):
        return self.run.save_weights_for_sampler().sampler_id

    def sample(
        self, snap, prompts: list[list[int]], seeds: list[int]
    ) -> list[list[tuple[list[int], list[float]]]]:
        params = [
            self.st.SamplingParams(max_tokens=self.a.max_tokens, temperature=1.0, seed=s) for s in seeds
        ]
        futs = [
            self.run.sample_async(p, self.a.group, q, sampler_id=snap)
            for p, q in zip(prompts, params, strict=True)
        ]
        return [[(list(s.tokens), list(s.logprobs)) for s in f.result().sequences] for f in futs]

    def train(self, rows: list[tuple[list[int], list[int], list[float], list[float]]]) -> None:
        data = [self.st.Datum.of(x, target_tokens=t, logprobs=lp, advantages=adv) for x, t, lp, adv in rows]
        fb = self.run.forward_backward_async(data, "importance_sampling")
        opt = self.run.optim_step_async(self.st.AdamParams(learning_rate=1e-5))
        fb.result()
        opt.result()

    def close(self) -> None:
        self.tc.close()


class TinkerLoop:
    """The same loop through the official tinker SDK and the gateway."""

    def __init__(self, url: str, a):
        os.environ.setdefault("TINKER_TELEMETRY", "0")
        import tinker
        from tinker import types

        self.types, self.a = types, a
        self.sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.tc = self.sc.create_lora_training_client(
            a.base, rank=16, seed=0, train_mlp=True, train_attn=True, train_unembed=False
        ).result()

    def snapshot(self):
        return self.tc.save_weights_and_get_sampling_client().result()

    def sample(self, snap, prompts, seeds):
        t = self.types
        futs = [
            snap.sample(
                t.ModelInput.from_ints(p),
                self.a.group,
                t.SamplingParams(max_tokens=self.a.max_tokens, temperature=1.0, seed=s),
            )
            for p, s in zip(prompts, seeds, strict=True)
        ]
        return [[(list(s.tokens), list(s.logprobs)) for s in f.result().sequences] for f in futs]

    def train(self, rows) -> None:
        t = self.types
        data = [
            t.Datum(
                model_input=t.ModelInput.from_ints(x),
                loss_fn_inputs={"target_tokens": tt_, "logprobs": lp, "advantages": adv},
            )
            for x, tt_, lp, adv in rows
        ]
        fb = self.tc.forward_backward(data, "importance_sampling")
        opt = self.tc.optim_step(t.AdamParams(learning_rate=1e-5))
        fb.result()
        opt.result()

    def close(self) -> None:
        pass


def rl_rows(prompt: list[int], group: list[tuple[list[int], list[float]]]):
    """Group-relative advantages of a verifiable reward (the share of even ids), as importance_sampling datums."""
    rewards = [sum(1 for x in toks if x % 2 == 0) / max(len(toks), 1) for toks, _ in group]
    mean = sum(rewards) / len(rewards)
    rows = []
    for (toks, lps), r in zip(group, rewards, strict=True):
        full = prompt + toks
        n_prompt = len(prompt) - 1
        rows.append(
            (
                full[:-1],
                full[1:],
                [0.0] * n_prompt + list(lps),
                [0.0] * n_prompt + [r - mean] * len(toks),
            )
        )
    return rows, rewards


def loop(system: str, a) -> LoopResult:
    res = LoopResult(system)
    work = tempfile.mkdtemp(prefix=f"strop-gateway-bench-{system}-")
    procs = Processes(a, work)
    driver = None
    try:
        trainer = procs.trainer()
        driver = GrpcLoop(trainer, a) if system == "grpc" else TinkerLoop(procs.gateway(trainer), a)
        rng = random.Random(0)
        vocab = a.vocab
        with GpuPeak() as peak:
            for step in range(a.warmup + a.steps):
                prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
                seeds = [step * 1000 + i for i in range(a.prompts)]
                t0 = time.perf_counter()
                snap = driver.snapshot()
                groups = driver.sample(snap, prompts, seeds)
                t1 = time.perf_counter()
                rows, rewards = [], []
                for p, g in zip(prompts, groups, strict=True):
                    r, w = rl_rows(p, g)
                    rows += r
                    rewards += w
                driver.train(rows)
                t2 = time.perf_counter()
                res.rewards.append(round(sum(rewards) / len(rewards), 4))
                if step < a.warmup:
                    continue
                res.steps += 1
                res.sample_s += t1 - t0
                res.train_s += t2 - t1
                res.sampled_tokens += sum(len(toks) for g in groups for toks, _ in g)
                res.trained_tokens += sum(len(x) for x, *_ in rows)
        res.peak_gpu_mib = peak.peak
        res.step_s = (res.sample_s + res.train_s) / max(res.steps, 1)
        res.sampled_tokens_per_s = res.sampled_tokens / res.sample_s if res.sample_s else 0.0
        res.trained_tokens_per_s = res.trained_tokens / res.train_s if res.train_s else 0.0
    except Exception as exc:
        import traceback

        traceback.print_exc()
        res.ok, res.error = False, f"{exc!r}"[:500] + f" (logs in {work})"
    finally:
        if driver is not None:
            driver.close()
        procs.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--systems", default="grpc,tinker", help="grpc: strop's SDK; tinker: the SDK via the gateway"
    )
    p.add_argument(
        "--quant", choices=("qlora", "lora"), default="qlora", help="NF4 base (qlora) or bf16 (lora)"
    )
    p.add_argument("--prompts", type=int, help="prompts a step (default 8; --smoke 2)")
    p.add_argument("--group", type=int, help="completions per prompt (default 8; --smoke 2)")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt (default 256; --smoke 8)")
    p.add_argument("--max-tokens", type=int, help="tokens per completion (default 256; --smoke 4)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (checks the harness)")
    a = p.parse_args()
    w = harness.workload("qlora", a.smoke)
    a.dtype, a.vocab = w.dtype, w.shape["vocab"]
    a.prompts = a.prompts or (2 if a.smoke else 8)
    a.group = a.group or (2 if a.smoke else 8)
    a.prompt_len = a.prompt_len or (8 if a.smoke else 256)
    a.max_tokens = a.max_tokens or (4 if a.smoke else 256)
    a.max_seq = a.prompt_len + a.max_tokens + 1
    a.quantization = "NF4" if a.quant == "qlora" else "NONE"
    w.ensure_saved_model(a.max_seq, "qlora")
    a.base = os.path.basename(w.saved_model_dir())
    results = [loop(s, a) for s in a.systems.split(",")]
    for r in results:
        if not r.ok:
            print(f"{r.system}: FAILED {r.error}")
            continue
        print(
            f"{r.system}: {r.step_s:.2f} s/step ({r.steps} steps), sampled {r.sampled_tokens_per_s:,.0f} tokens/s, "
            f"trained {r.trained_tokens_per_s:,.0f} tokens/s, peak GPU {r.peak_gpu_mib:,.0f} MiB, rewards {r.rewards}"
        )
    by = {r.system: r for r in results if r.ok}
    if "grpc" in by and "tinker" in by:
        print(f"gateway overhead: step time tinker / grpc = {by['tinker'].step_s / by['grpc'].step_s:.3f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
