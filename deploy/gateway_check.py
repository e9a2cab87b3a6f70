"""Start the gateway image's two gateways from its own filesystem and drive them with the official SDKs, ``tinker``
and ``openai`` (``deploy/test-deploy.sh gateway``).

As in ``image_check.py`` (whose ``Rootfs`` this uses): a buildah working container of the image is mounted,
``/proc``, ``/dev`` and ``/data`` are bound into it, and the image's own entrypoint (``strop serve``) runs chrooted
into that filesystem as the image's user, with only the image's environment. The trainer it calls runs from this
checkout's venv (the gateway image holds no trainer): a tiny fp32 Llama under ``/data/models``, tokens for one
tenant and one admin.

The run, end to end:

1. the image's facts: non-root user, no torch, no compiler, the entrypoint;
2. the gateway starts (``tinker --listen … --trainer … --admin-token-file … --health-port …``); its plaintext
   ``/healthz`` and ``/readyz`` must answer 200;
3. the SDK (on the host) creates a LoRA training client on the base, which the gateway loads once as a shared
   session with the admin token, and trains 6 forward_backward + optim_step steps: the loss must fall; then
   ``save_weights_and_get_sampling_client`` and a sample with log-probs;
4. the OpenAI gateway starts from the same entrypoint (``openai --listen … --state-dir /data/state/openai``,
   SQLite); the openai SDK lists the models, uploads a chat JSONL and runs a fine-tuning job of one epoch, which
   must succeed with a fine-tuned model;
5. SIGTERM to both: each must exit 0 within 30 s.

Prints one JSON summary line (``gateway-check: {...}``) and exits non-zero on any failure. Run as root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deploy/ is not a package (python -P drops it)
from image_check import Rootfs

TENANT, ADMIN = "tml-image-check-tenant-0001", "tml-image-check-admin-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()
    except OSError as e:
        return 0, str(e)


def start_trainer(vpy: str, data: Path, logs: Path) -> tuple[subprocess.Popen, int]:
    port_file = data / "state" / "trainer.port"
    args = [
        vpy,
        "-m",
        "strop.trainer_svc",
        "--address",
        "127.0.0.1:0",
        "--port-file",
        str(port_file),
        "--model-root",
        str(data / "models"),
        "--artifact-root",
        str(data / "artifacts"),
        "--state-dir",
        str(data / "state" / "trainer"),
        "--data-root",
        str(data / "datasets"),
        "--auth-tokens",
        str(data / "tokens.json"),
        "--device",
        "cpu",
        "--grace",
        "5",
    ]
    proc = subprocess.Popen(args, stdout=(logs / "trainer.log").open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the trainer did not start:\n{(logs / 'trainer.log').read_text()[-3000:]}")
        time.sleep(0.3)
    return proc, int(port_file.read_text())


def drive(url: str) -> dict:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=TENANT)
    tc = sc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
    seq = list(range(40, 61))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    losses = []
    t0 = time.monotonic()
    for _ in range(6):
        losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    train_s = time.monotonic() - t0
    if not losses[-1] < 0.9 * losses[0]:
        raise RuntimeError(f"expected the loss to fall by 10% or more in 6 steps, got {losses}")
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints(seq[:5]), 1, types.SamplingParams(max_tokens=4, temperature=0.0)
    ).result()
    seq0 = out.sequences[0]
    if len(seq0.tokens) != 4 or len(seq0.logprobs or []) != 4:
        raise RuntimeError(f"expected 4 sampled tokens with log-probs, got {seq0}")
    return {
        "model_id": tc.model_id,
        "losses": [round(x, 3) for x in losses],
        "train_s": round(train_s, 1),
        "sampled": list(seq0.tokens),
    }


def drive_openai(url: str) -> dict:
    import openai

    c = openai.OpenAI(base_url=f"{url}/v1", api_key=TENANT, max_retries=0)
    models = sorted(m.id for m in c.models.list())
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(8)
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = c.files.create(file=("train.jsonl", data), purpose="fine-tune")
    t0 = time.monotonic()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama", training_file=f.id, hyperparameters={"n_epochs": 1, "batch_size": 4}
    )
    while job.status not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"job {job.id} stayed {job.status}")
        time.sleep(0.5)
        job = c.fine_tuning.jobs.retrieve(job.id)
    if job.status != "succeeded" or not job.fine_tuned_model:
        raise RuntimeError(
            f"job {job.id}: expected succeeded with a fine-tuned model, got {job.status} {job.error}"
        )
    return {
        "models": models,
        "file": f.id,
        "job": job.id,
        "status": job.status,
        "fine_tuned_model": job.fine_tuned_model,
        "job_s": round(time.monotonic() - t0, 1),
    }


def stop(proc: subprocess.Popen, name: str, log: Path) -> dict:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(30)
    if rc != 0:
        raise RuntimeError(f"the {name} gateway exited {rc} after SIGTERM (log {log})")
    return {"rc": rc, "drain_s": round(time.monotonic() - t0, 1)}


def wait_http(url: str, proc: subprocess.Popen, log: Path) -> float:
    t0 = time.monotonic()
    while get(url)[0] != 200:
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError(f"{url} did not answer 200:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return round(time.monotonic() - t0, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway-image", required=True)
    p.add_argument("--work", type=Path, required=True, help="host directory for /data and the logs")
    p.add_argument("--python", default=sys.executable, help="the checkout's venv Python: runs the trainer")
    a = p.parse_args()
    run_dir = a.work / "run-gateway"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    data, logs = run_dir / "data", run_dir / "logs"
    for d in (data / "models", data / "artifacts", data / "state", data / "datasets", logs):
        d.mkdir(parents=True)
    subprocess.run(
        [a.python, "-m", "strop.fixtures", str(data / "models" / "tiny-llama")],
        check=True,
        stdout=(logs / "fixtures.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    tokens = {
        "tokens": [{"tenant": "t", "token": TENANT}, {"tenant": "ops", "token": ADMIN, "role": "admin"}]
    }
    (data / "tokens.json").write_text(json.dumps(tokens))
    (data / "admin-token").write_text(ADMIN + "\n")
    fs = Rootfs(a.gateway_image)
    summary: dict = {}
    trainer = gateway = None
    try:
        fs.open(data)
        os.chown(data / "admin-token", fs.uid, fs.gid)
        (data / "state" / "openai").mkdir()
        os.chown(
            data / "state" / "openai", fs.uid, fs.gid
        )  # the OpenAI gateway's state dir, as volume-init does
        os.chmod(data / "admin-token", 0o400)
        site = next((fs.root / "opt/strop/lib").glob("python3*/site-packages"))
        summary["image_facts"] = {
            "user": f"{fs.uid}:{fs.gid}",
            "entrypoint": fs.entrypoint,
            "torch": (site / "torch").exists(),
            "compiler": any(fs.has(c) for c in ("/usr/bin/gcc", "/usr/bin/cc")),
            "site_packages_mb": round(sum(f.stat().st_size for f in site.rglob("*") if f.is_file()) / 2**20),
        }
        facts = summary["image_facts"]
        if facts["torch"] or facts["compiler"] or fs.uid == 0 or fs.entrypoint[-1:] != ["serve"]:
            raise RuntimeError(f"expected a torch- and compiler-free, non-root `strop serve` image: {facts}")
        trainer, tport = start_trainer(a.python, data, logs)
        port, health = free_port(), free_port()
        gateway = fs.popen(
            [
                *fs.entrypoint,
                "tinker",
                "--listen",
                f"127.0.0.1:{port}",
                "--trainer",
                f"127.0.0.1:{tport}",
                "--model-root",
                "/data/models",
                "--quantization",
                "NONE",
                "--dtype",
                "float32",
                "--admin-token-file",
                "/data/admin-token",
                "--health-port",
                str(health),
            ],
            logs / "gateway.log",
        )
        summary["ready_s"] = wait_http(f"http://127.0.0.1:{health}/readyz", gateway, logs / "gateway.log")
        summary["health"] = {
            path: get(f"http://127.0.0.1:{health}{path}") for path in ("/healthz", "/readyz")
        }
        summary["tinker"] = drive(f"http://127.0.0.1:{port}")
        summary["stop"] = stop(gateway, "tinker", logs / "gateway.log")
        oport = free_port()
        oai = fs.popen(
            [
                *fs.entrypoint,
                "openai",
                "--listen",
                f"127.0.0.1:{oport}",
                "--trainer",
                f"127.0.0.1:{tport}",
                "--model-root",
                "/data/models",
                "--state-dir",
                "/data/state/openai",
                "--quantization",
                "NONE",
                "--dtype",
                "float32",
            ],
            logs / "openai.log",
        )
        gateway = oai
        summary["openai_ready_s"] = wait_http(f"http://127.0.0.1:{oport}/healthz", oai, logs / "openai.log")
        summary["openai"] = drive_openai(f"http://127.0.0.1:{oport}")
        summary["openai_stop"] = stop(oai, "openai", logs / "openai.log")
    except Exception:
        for name in ("gateway", "openai", "trainer"):
            log = logs / f"{name}.log"
            if log.exists():
                print(f"--- {name} log (tail) ---\n{log.read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        for proc in (gateway, trainer):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        fs.close()
    print("gateway-check: " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
