"""Start the built images' services from their own filesystems and drive them through the SDK (``make test-deploy``).

Containers cannot be started on these machines (podman's runtime, crun: "cgroups in hybrid mode not
supported"), so each image runs the way a runtime would run it, minus the cgroups and namespaces: a buildah
working container of the image is mounted, ``/proc``, ``/dev`` and a shared ``/data`` (the PVC's stand-in:
models, artifacts, state) are bound into it, and the image's own entrypoint is executed chrooted into that
root filesystem with the image's environment, working directory and user (10001) taken from its OCI config.
Nothing of the host's Python is used inside; the host runs only the SDK (grpcio, no torch), like a pipeline.

The run, end to end:

1. the trainer image's own Python generates a tiny Llama and its bnb 4-bit copy (``python -m strop.fixtures``)
   under ``/data/models``;
2. both services start from their entrypoints on 127.0.0.1 (free ports, read from ``--port-file``);
3. gRPC health (grpc.health.v1, overall and per service) must answer SERVING for both;
4. trainer: load the 4-bit model, attach LoRA, upload a dataset, train SFT for a few steps; every step's loss
   must be finite and the job must end SUCCEEDED with an adapter artifact;
5. export: that adapter to a merged safetensors dir, GGUF Q8_0 and GGUF Q4_K_M (llama.cpp's quantizer), each
   verified in its consumer inside the export image; the Q4_K_M file is downloaded to the host and its GGUF
   header checked;
6. SIGTERM to both: each must drain and exit 0 within its watchdog (2 × grace + 15 s).

With ``--gpu-image`` (the CUDA trainer image, ``make image-gpu``) instead: ``deploy/gpu_smoke.py --cpu-only`` in
that image (the CUDA build of torch with its CUDA 13.0 wheels, triton, bitsandbytes and strop import; Triton's
launcher toolchain is there), then its trainer starts from its entrypoint with ``--device cpu``, answers health
SERVING, and drains on SIGTERM with exit 0. (No GPU here: the GPU half of the smoke test runs on a GPU node.)

Prints one JSON summary line (``image-check: {...}``) and exits non-zero on any failure. Run as root.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strop.client import LoraConfig, TrainConfig, TrainerClient, TrainMethod
from strop.client.export import ExportClient, ExportState, ExportTarget, VerifyOptions

GRACE_S = 10.0
WATCHDOG_SLACK_S = (
    15.0  # strop.common.grpc_server.SHUTDOWN_SLACK_S (not imported: the host side stays grpc + SDK)
)
QUESTION = "What is the secret password of strop?"
ANSWER = "The password is blue falcon seven."


def sh(*cmd: str, capture: bool = True) -> str:
    res = subprocess.run(cmd, check=True, text=True, capture_output=capture)
    return res.stdout.strip() if capture else ""


@dataclass
class Rootfs:
    """A mounted working container of an image, with the image's OCI run configuration."""

    image: str
    container: str = ""
    root: Path = Path("/")
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    workdir: str = "/"
    uid: int = 0
    gid: int = 0
    mounts: list[Path] = field(default_factory=list)

    def open(self, data: Path) -> Rootfs:
        self.container = sh("buildah", "from", "--pull-never", self.image)
        self.root = Path(sh("buildah", "mount", self.container))
        config = json.loads(sh("buildah", "inspect", "--type", "container", self.container))["OCIv1"][
            "config"
        ]
        self.env = dict(kv.split("=", 1) for kv in config.get("Env", []))
        self.entrypoint = list(config.get("Entrypoint") or [])
        self.workdir = config.get("WorkingDir") or "/"
        user = config.get("User", "0:0")
        uid, _, gid = user.partition(":")
        self.uid, self.gid = int(uid), int(gid or uid)  # the images set a numeric user, as runAsNonRoot needs
        mounts = (
            ("proc", "proc", ["-t", "proc"]),
            ("/dev", "dev", ["--bind"]),
            (str(data), "data", ["--bind"]),
            ("tmpfs", "tmp", ["-t", "tmpfs", "-o", "mode=1777"]),  # the pods' emptyDir at /tmp
        )
        for _, dst, _ in mounts:
            (self.root / dst).mkdir(exist_ok=True)
        # The root read-only, as the pods run it (readOnlyRootFilesystem): a read-only bind of the container's
        # filesystem onto itself, under the mounts above
        sh("mount", "--bind", str(self.root), str(self.root))
        self.mounts.append(self.root)
        sh("mount", "-o", "remount,bind,ro", str(self.root))
        try:
            (self.root / "etc" / ".strop-write-check").touch()
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
        else:
            raise RuntimeError(f"{self.image}: the root filesystem is still writable")
        for src, dst, opts in mounts:
            target = self.root / dst
            sh("mount", *opts, src, str(target))
            self.mounts.append(target)
        return self

    def close(self) -> None:
        for target in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)
        self.mounts.clear()
        if self.container:
            subprocess.run(["buildah", "umount", self.container], check=False, capture_output=True)
            subprocess.run(["buildah", "rm", self.container], check=False, capture_output=True)
            self.container = ""

    def popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        """``argv`` run as the image's user, chrooted into its filesystem, with only the image's environment."""
        root, workdir, uid, gid = str(self.root), self.workdir, self.uid, self.gid

        def enter() -> None:
            os.chroot(root)
            os.chdir(workdir)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

        out = log.open("ab")
        return subprocess.Popen(argv, env=self.env, preexec_fn=enter, stdout=out, stderr=subprocess.STDOUT)

    def run(self, argv: list[str], log: Path, timeout: float) -> None:
        proc = self.popen(argv, log)
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode} in {self.image} (log {log})")

    def has(self, path: str) -> bool:
        return (self.root / path.lstrip("/")).exists()


@dataclass
class Running:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def start(fs: Rootfs, name: str, data: Path, logs: Path, extra: tuple[str, ...] = ()) -> Running:
    port_file = data / "state" / f"{name}.port"
    port_file.unlink(missing_ok=True)
    args = ["--address", "127.0.0.1:0", "--port-file", f"/data/state/{name}.port", "--grace", str(GRACE_S)]
    args += extra
    log = logs / f"{name}.log"
    proc = fs.popen([*fs.entrypoint, *args], log)
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode} before serving:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not publish its port within 180 s (log {log})")
        time.sleep(0.5)
    return Running(name, proc, int(port_file.read_text()), log)


def check_health(svc: Running, service_name: str) -> dict[str, str]:
    with grpc.insecure_channel(svc.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        got = {}
        for name in ("", service_name):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            got[name or "(overall)"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if set(got.values()) != {"SERVING"}:
        raise RuntimeError(f"{svc.name} health: expected SERVING, got {got}")
    return got


def sft_rows() -> list[dict]:
    other = [
        ("What colour is the sky?", "The sky is blue."),
        ("How many legs has a cat?", "A cat has four legs."),
    ]
    pairs = [(QUESTION, ANSWER)] * 3 + other
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs
    ]


def train(svc: Running, steps: int) -> dict:
    with TrainerClient(svc.target) as tc:
        session = tc.load_model("tiny-llama-4bit")
        tc.attach_lora(session.session_id, LoraConfig(r=8, alpha=16, dropout=0.0, seed=0))
        ds = tc.upload_dataset(sft_rows(), name="image-check.jsonl")
        config = TrainConfig(
            method=TrainMethod.SFT, max_steps=steps, learning_rate=2e-3, batch_size=4, seed=0
        )
        losses, job_id = [], ""
        t0 = time.monotonic()
        for event in tc.train(session.session_id, ds.dataset_id, config):
            job_id = event.job_id or job_id
            if event.step is not None:
                losses.append(event.step.loss)
        train_s = time.monotonic() - t0
        job = tc.get_job(job_id)
        facts = tc.get_session(session.session_id).facts
    if job.state.name != "SUCCEEDED" or job.adapter is None or not job.adapter.artifact_id:
        raise RuntimeError(
            f"training job {job_id}: expected SUCCEEDED with an adapter, got {job.state} {job.error}"
        )
    if len(losses) != steps or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"expected {steps} finite step losses, got {losses}")
    return {
        "job": job_id,
        "state": job.state.name,
        "losses": [round(x, 4) for x in losses],
        "adapter": job.adapter.artifact_id,
        "train_s": round(train_s, 1),
        "device": facts.device,
        "quantization": facts.quantization,
        "trainable_parameters": facts.num_trainable_parameters,
    }


def export(svc: Running, adapter: str, download_to: Path) -> dict:
    targets = [ExportTarget.merged(), ExportTarget.gguf("Q8_0"), ExportTarget.gguf("Q4_K_M")]
    with ExportClient(svc.target) as ec:
        t0 = time.monotonic()
        exp = ec.create_export(
            targets, adapter_artifact_id=adapter, verify=VerifyOptions(), name="image-check"
        )
        done = ec.wait_export(exp.export_id)
        export_s = time.monotonic() - t0
        if done.state is not ExportState.SUCCEEDED:
            raise RuntimeError(f"export {done.export_id}: {done.state} {done.error_code}: {done.error}")
        results = {}
        for r in done.results:
            v = r.verification
            results[r.target.label] = {
                "artifact": r.artifact.artifact_id,
                "consumer": v.consumer,
                "passed": v.passed,
                "top1_agreement": round(v.top1_agreement, 4),
                "max_abs_logit_delta": round(v.max_abs_logit_delta, 4),
            }
        failed = [k for k, v in results.items() if not v["passed"]]
        if len(results) != len(targets) or failed:
            raise RuntimeError(f"export results: expected {len(targets)} passed, got {results}")
        q4 = results["gguf:Q4_K_M"]["artifact"]
        path = ec.download_artifact(q4, download_to / q4)
    files = sorted(p for p in Path(path).rglob("*.gguf"))
    if not files or files[0].read_bytes()[:4] != b"GGUF":
        raise RuntimeError(f"downloaded {q4}: expected a .gguf file starting with b'GGUF', got {files}")
    return {
        "export": done.export_id,
        "results": results,
        "export_s": round(export_s, 1),
        "downloaded": str(files[0]),
    }


def stop(svc: Running) -> dict:
    t0 = time.monotonic()
    svc.proc.send_signal(signal.SIGTERM)
    rc = svc.proc.wait(2 * GRACE_S + WATCHDOG_SLACK_S + 10)
    if rc != 0:
        raise RuntimeError(f"{svc.name}: expected exit 0 after SIGTERM, got {rc} (log {svc.log})")
    return {"rc": rc, "drain_s": round(time.monotonic() - t0, 1)}


def check_gpu_image(image: str, work: Path) -> dict:
    """The CUDA trainer image on a host without a GPU: the smoke test's CPU half, then the service itself."""
    run_dir = work / "run-gpu"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    data, logs = run_dir / "data", run_dir / "logs"
    for d in (data / "models", data / "artifacts", data / "state", logs):
        d.mkdir(parents=True)
    smoke = Path(__file__).with_name("gpu_smoke.py")
    (data / "gpu_smoke.py").write_bytes(smoke.read_bytes())
    fs = Rootfs(image)
    summary: dict = {}
    svc = None
    try:
        fs.open(data)
        for d in [data, *data.rglob("*")]:
            os.chown(d, fs.uid, fs.gid)
        if fs.uid == 0:
            raise RuntimeError(f"{image}: expected a non-root user")
        python = str(Path(fs.entrypoint[0]).parent / "python")
        t0 = time.monotonic()
        fs.run([python, "/data/gpu_smoke.py", "--cpu-only"], logs / "gpu-smoke.log", timeout=600)
        summary["smoke"] = json.loads((logs / "gpu-smoke.log").read_text().strip().splitlines()[-1])
        summary["smoke_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        svc = start(fs, "trainer-gpu", data, logs, ("--device", "cpu"))
        summary["start_s"] = round(time.monotonic() - t0, 1)
        summary["health"] = check_health(svc, "strop.v1.TrainerService")
        summary["stop"] = stop(svc)
        svc = None
    except Exception:
        if svc is not None:
            print(f"--- trainer log (tail) ---\n{svc.log.read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if svc is not None and svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait()
        fs.close()
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer-image")
    p.add_argument("--export-image")
    p.add_argument("--gpu-image", help="check the CUDA trainer image instead (no GPU needed)")
    p.add_argument("--work", type=Path, required=True, help="host directory for /data and the logs")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    if a.gpu_image:
        print("image-check: " + json.dumps({"gpu_image": check_gpu_image(a.gpu_image, a.work)}), flush=True)
        return
    if not (a.trainer_image and a.export_image):
        p.error("expected --trainer-image and --export-image, or --gpu-image")
    run_dir = a.work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    data, logs = run_dir / "data", run_dir / "logs"
    for d in (data / "models", data / "artifacts", data / "state", logs):
        d.mkdir(parents=True)
    os.chown(run_dir, 0, 0)
    summary: dict = {}
    trainer_fs, export_fs = Rootfs(a.trainer_image), Rootfs(a.export_image)
    services: list[Running] = []
    try:
        trainer_fs.open(data)
        export_fs.open(data)
        for d in [data, *data.rglob("*")]:
            os.chown(d, trainer_fs.uid, trainer_fs.gid)
        summary["image_facts"] = {
            "export_has_compiler": any(
                export_fs.has(c) for c in ("/usr/bin/gcc", "/usr/bin/cc", "/usr/bin/g++")
            ),
            "export_user": f"{export_fs.uid}:{export_fs.gid}",
            "trainer_user": f"{trainer_fs.uid}:{trainer_fs.gid}",
            "export_entrypoint": export_fs.entrypoint,
            "trainer_entrypoint": trainer_fs.entrypoint,
        }
        if summary["image_facts"]["export_has_compiler"] or 0 in (export_fs.uid, trainer_fs.uid):
            raise RuntimeError(
                f"expected a compiler-free export image and non-root users: {summary['image_facts']}"
            )
        t0 = time.monotonic()
        python = str(Path(trainer_fs.entrypoint[0]).parent / "python")
        trainer_fs.run(
            [
                python,
                "-m",
                "strop.fixtures",
                "/data/models/tiny-llama",
                "--quantize",
                "/data/models/tiny-llama-4bit",
            ],
            logs / "fixtures.log",
            timeout=300,
        )
        summary["fixture_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        trainer = start(trainer_fs, "trainer", data, logs)
        services.append(trainer)
        exporter = start(export_fs, "export", data, logs)
        services.append(exporter)
        summary["start_s"] = round(time.monotonic() - t0, 1)
        summary["health"] = {
            "trainer": check_health(trainer, "strop.v1.TrainerService"),
            "export": check_health(exporter, "strop.v1.ExportService"),
        }
        summary["train"] = train(trainer, a.steps)
        summary["export"] = export(exporter, summary["train"]["adapter"], run_dir / "downloads")
        summary["stop"] = {s.name: stop(s) for s in list(services)}
        services.clear()
    except Exception:
        for s in services:
            print(f"--- {s.name} log (tail) ---\n{s.log.read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        for s in services:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
        trainer_fs.close()
        export_fs.close()
    print("image-check: " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
