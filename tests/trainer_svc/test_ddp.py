"""DDP through torch.distributed (gloo, 2 processes) trains exactly what one process trains on the same global batch.

The same job runs twice through the distributed entry point (``strop.trainer_svc.dist_worker``): with 2 processes
of batch 1 (started as a Kubeflow TrainJob's pod starts it, by torchrun's ``PET_*`` variables; the stop test and
the service's tests run torchrun's command line), and as one process of batch 2. Each rank takes every other batch of the one
shuffled order, so at every step the two runs see the same 2 rows, and DDP averages the two ranks' gradients
(transformers scales each rank's loss by the world size over the global token count, so the average is the
gradient of the global batch's mean loss). Per-step losses and the final adapter must agree to rounding.

Why SGD without clipping. AdamW divides each update by its gradient's own magnitude and clipping rescales it, so
with either, a DDP whose gradients are summed instead of averaged (2x the gradient) would train nearly the same
adapter and this test could not see it; with plain SGD the update is linear in the gradient, and a summed gradient
doubles it. Checked by hand with a DDP comm hook: summing instead of averaging moves the adapter's update by 117%
and the losses by 3.8e-3, never synchronising by 107% and 2.0e-3, against bounds of 2.2e-4 and 5.4e-5 (measured
here: 3.0e-7 and 7.4e-8). SGD also keeps the bound derivable: no m/sqrt(v) amplifies rounding.

The bound, derived as in ``tests/kernels/models/test_patch.py``. Both runs compute the same fp32 function; they differ
in summation order (batch 2 in one process against batch 1 per rank) and in one more addition, the all-reduce
of two fp32 gradient halves (one rounding per element). One forward and backward passes through ``S`` = 8
sequential reductions per layer and pass, twice, plus 4 for the head and the loss, of at most ``K`` terms (the
longest of hidden, intermediate, vocabulary, and the tokens of a global batch summed into a LoRA gradient):
a gradient is off by at most ε = (S·√K + 1)·u relative, u = 2⁻²⁴. A step's loss is one forward of that (S·√K·u
covers it and the rounding its weights carry from earlier steps, whose effect on the loss is ‖g‖·‖Δθ‖ ≪ the
loss). The adapter's update after T SGD steps is a sum of T updates each off by at most ε relative: T·ε. A
wrong gradient, a wrong shard of the data or an unsynchronised rank is off by O(1).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 4
ROWS = 8  # 2 rows a global batch, each row of the same length: no padding on either side
ROW_TOKENS = 24
U = 2.0**-24
ROOT = Path(__file__).resolve().parents[2]
LORA = {"r": 4, "alpha": 8, "seed": 1}


def _spec(job_id: str, batch_size: int) -> dict:
    return {
        "job_id": job_id,
        "model": {
            "model_path": "tiny-llama",
            "quantization": "NONE",
            "dtype": "float32",
            "max_seq_length": 64,
        },
        "lora": LORA,
        "config": {
            "method": "SFT",
            "optimizer": "sgd",
            "learning_rate": 0.5,
            "max_steps": STEPS,
            "batch_size": batch_size,
            "max_grad_norm": 1e9,
            "loss_on_all_tokens": True,
            "checkpoint_every_steps": 2,
            "seed": 3,
        },
        "dataset_path": "tokens.jsonl",
        "tenant": "team-a",
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    tmp: Path,
    model_root: Path,
    job_id: str,
    batch_size: int,
    nproc: int,
    spec: dict | None = None,
    operator_env: bool = False,
) -> subprocess.Popen:
    """Run the job's entry point: under torchrun for ``nproc`` > 1, or, with ``operator_env``, plainly with the
    ``PET_*`` variables a Kubeflow TrainJob's torch runtime sets (the entry point hands itself to torchrun)."""
    spec_file = tmp / f"{job_id}.json"
    spec_file.write_text(json.dumps(spec or _spec(job_id, batch_size)))
    worker = [
        "-m",
        "strop.trainer_svc.dist_worker",
        "--spec",
        str(spec_file),
        "--model-root",
        str(model_root),
        "--artifact-root",
        str(tmp / "artifacts"),
        "--data-root",
        str(tmp / "data"),
        "--work-dir",
        str(tmp / "work"),
        "--events",
        str(tmp / f"{job_id}.events"),
    ]
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # a rank killed by a signal (an abort, a segfault) writes every thread's Python stack, and C++ errors their stack
    env.update(PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1")
    env.pop("RANK", None)
    if operator_env:
        launcher = []
        env.update(
            PET_NNODES="1",
            PET_NPROC_PER_NODE=str(nproc),
            PET_NODE_RANK="0",
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=str(_free_port()),
        )
    return _start([sys.executable, *launcher, *worker], env, tmp / f"{job_id}.log")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Run ``argv`` from the repository root, its output to ``log``; the environment kept on the process for
    :func:`_finish`'s relaunch (a Popen does not hold it)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.strop_env = env
    return proc


FAILURE_LINE = re.compile(r"Error|Exception|Fatal|terminate|what\(\)|[Aa]bort|Signal|^\s*File \"|^Thread 0x")


def _log(tmp: Path, job_id: str) -> str:
    """A job's log for an assertion message: its tail, then the lines that name the failure (an exception, an
    abort's reason, the stacks a fatal signal wrote) last, where a report that keeps only the end of the output
    (CI's) still shows them."""
    text = (tmp / f"{job_id}.log").read_text(errors="replace")
    named = [line for line in text.splitlines() if FAILURE_LINE.search(line)]
    return text[-3000:] + "\n-- the log's lines that name the failure --\n" + "\n".join(named[-30:])


# a process killed by one of these died in native code (a library's abort, a bad access), not in strop's Python
CRASH_SIGNALS = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 11: "SIGSEGV"}


def _crash_signal(proc: subprocess.Popen, log: str) -> str | None:
    """The native crash that ended a failed launch: the process's own signal, or the one torchrun names as the
    root cause (its summary's first failure: ``exitcode : -6``), else None (an exit code is a failure the job
    reported)."""
    code = -proc.returncode if proc.returncode < 0 else None
    root = log.rpartition("Root Cause")[2] if "Root Cause" in log else ""
    named = re.search(r"exitcode\s*:\s*-(\d+)", root)
    code = int(named.group(1)) if named else code
    return CRASH_SIGNALS.get(code)


def _finish(proc: subprocess.Popen, tmp: Path, job_id: str, timeout: float) -> None:
    """Wait for a launch that must succeed. A process killed by a native crash signal (seen once in CI: a rank's
    SIGABRT, its log cut from the report) is relaunched once from scratch, with a warning carrying the log's
    failure lines, so the report names the crash; a second crash, or any failure the job itself reports, fails."""
    code = proc.wait(timeout=timeout)
    if code != 0 and (crash := _crash_signal(proc, (tmp / f"{job_id}.log").read_text(errors="replace"))):
        import shutil
        import warnings

        warnings.warn(
            f"{job_id}: a process died of {crash}; relaunched once. {_log(tmp, job_id)}", stacklevel=2
        )
        (tmp / f"{job_id}.events").unlink(missing_ok=True)
        shutil.rmtree(tmp / "work" / job_id, ignore_errors=True)
        code = _start(proc.args, proc.strop_env, tmp / f"{job_id}.log").wait(timeout=timeout)
    assert code == 0, _log(tmp, job_id)


def _events(tmp: Path, job_id: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / f"{job_id}.events").read_text().splitlines()]


def _initial_adapter(model_root: Path) -> dict:
    """The adapter before training, as every rank attaches it (``attach_lora`` is seeded)."""
    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.trainer_svc.core import model_loading

    req = LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE, dtype="float32")
    loaded = model_loading.load_model(req, model_root=model_root, device="cpu")
    model_loading.attach_lora(loaded, LoraConfig(**LORA))
    return {
        n.replace(".default", ""): p.detach().clone()
        for n, p in loaded.model.named_parameters()
        if p.requires_grad
    }


@pytest.fixture(scope="module")
def runs(model_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    (tmp / "data").mkdir()
    config = json.loads((model_root / "tiny-llama" / "config.json").read_text())
    rng = random.Random(0)
    with open(tmp / "data" / "tokens.jsonl", "w") as f:
        for _ in range(ROWS):
            row = [rng.randrange(3, config["vocab_size"]) for _ in range(ROW_TOKENS)]
            f.write(json.dumps({"input_ids": row}) + "\n")
    procs = {
        "job-one": _launch(tmp, model_root, "job-one", batch_size=2, nproc=1),
        "job-ddp": _launch(tmp, model_root, "job-ddp", batch_size=1, nproc=2, operator_env=True),
    }
    initial = _initial_adapter(model_root)  # while the two runs train
    for job_id, proc in procs.items():
        _finish(proc, tmp, job_id, timeout=300)
    return tmp, config, initial


def _adapter(tmp: Path, events: list[dict]) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from strop.common.artifacts import ArtifactStore

    (key,) = [_key(e["adapter"]) for e in events if e["adapter"]]  # the job's tenant's id space
    store = ArtifactStore(tmp / "artifacts")
    artifact = store.verify(key)
    return load_file(str(store.path_of(key) / "adapter_model.safetensors")), artifact.metadata


def _key(artifact: dict) -> str:
    """The store key of an artifact event's artifact: ranks publish in the job's tenant's id space."""
    from strop.common.artifacts import key_of

    return key_of(artifact["metadata"].get("tenant", ""), artifact["artifact_id"])


def _bounds(config: dict) -> tuple[float, float]:
    s = 8 * config["num_hidden_layers"] * 2 + 4
    k = max(config["hidden_size"], config["intermediate_size"], config["vocab_size"], 2 * ROW_TOKENS)
    loss_bound = s * math.sqrt(k) * U
    return loss_bound, STEPS * (s * math.sqrt(k) + 1) * U


@pytest.mark.parity
def test_ddp_losses_and_adapter_equal_one_process_on_the_global_batch(runs):
    tmp, config, initial = runs
    loss_bound, update_bound = _bounds(config)
    one, ddp = _events(tmp, "job-one"), _events(tmp, "job-ddp")
    losses_one = [e["step"]["loss"] for e in one if e["step"]]
    losses_ddp = [e["step"]["loss"] for e in ddp if e["step"]]
    assert len(losses_one) == len(losses_ddp) == STEPS  # one event a step, from rank 0 only
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses_ddp, losses_one, strict=True))
    assert worst_loss <= loss_bound, (losses_ddp, losses_one, loss_bound)

    adapter_one, _ = _adapter(tmp, one)
    adapter_ddp, _ = _adapter(tmp, ddp)
    assert sorted(adapter_ddp) == sorted(adapter_one) == sorted(initial)
    import torch

    def norm(tensors) -> float:
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))

    update = norm(adapter_one[n] - initial[n] for n in initial)
    delta = norm(adapter_ddp[n] - adapter_one[n] for n in initial)
    # the update is real (a fresh adapter's B is zero: what B holds now, SGD put there), and DDP's equals it
    assert update > 0.01 * norm(initial.values()), (update, norm(initial.values()))
    assert delta / update <= update_bound, (delta / update, update_bound)


def test_ddp_rank_zero_alone_publishes_with_the_single_process_metadata(runs):
    tmp, _, initial = runs
    one, ddp = _events(tmp, "job-one"), _events(tmp, "job-ddp")
    # rank 0's events only: a second rank's would double every step, checkpoint and adapter
    assert _kinds(ddp) == [
        "state",
        "log",
        "step",
        "step",
        "checkpoint",
        "step",
        "step",
        "checkpoint",
        "adapter",
        "state",
    ]
    assert [e["seq"] for e in ddp] == list(range(1, len(ddp) + 1))
    assert ddp[-1]["state"] == {"state": "SUCCEEDED", "message": f"finished at step {STEPS}"}
    # DDP all-reduces the adapters only: 2 layers x 7 projections x (A, B)
    assert ddp[1]["log"]["message"].startswith(
        f"DDP over 2 processes synchronises {len(initial)} adapter tensors"
    )
    _, meta_one = _adapter(tmp, one)
    _, meta_ddp = _adapter(tmp, ddp)
    assert meta_ddp == {**meta_one, "job_id": "job-ddp", "world_size": "2"}
    assert meta_ddp["tenant"] == "team-a" and meta_ddp["step"] == str(STEPS)
    from strop.common.artifacts import ArtifactStore

    store = ArtifactStore(tmp / "artifacts")
    for e in (e for e in ddp if e["checkpoint"]):
        artifact = store.verify(_key(e["checkpoint"]["artifact"]))
        assert artifact.metadata["job_id"] == "job-ddp" and artifact.metadata["tenant"] == "team-a"
        assert (store.path_of(_key(e["checkpoint"]["artifact"])) / "adapter_model.safetensors").is_file()


def _kinds(events: list[dict]) -> list[str]:
    return [next(k for k in ("state", "step", "checkpoint", "adapter", "log") if e[k]) for e in events]


def test_a_sigterm_to_one_rank_stops_every_rank_interrupted_and_the_job_resumes(runs, model_root):
    import signal
    import time

    import psutil

    tmp, _, _ = runs
    spec = _spec("job-stop", batch_size=1)
    spec["config"].update(max_steps=10_000, checkpoint_every_steps=0)  # runs until stopped
    proc = _launch(tmp, model_root, "job-stop", batch_size=1, nproc=2, spec=spec)
    events = tmp / "job-stop.events"
    deadline = time.monotonic() + 120
    while not (events.is_file() and '"step": {' in events.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, _log(tmp, "job-stop")
        time.sleep(0.1)
    (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGTERM)  # rank 1 alone: rank 0 learns it through the stop agreement
    assert proc.wait(timeout=120) == 0, _log(tmp, "job-stop")  # no relaunch: the stop is the test
    stopped = _events(tmp, "job-stop")
    steps = [e["step"]["step"] for e in stopped if e["step"]]
    stop_step = steps[-1]
    # both ranks stopped after the same step: had rank 1 stopped alone, rank 0 would wait in an all-reduce
    # and torchrun would fail the run; one checkpoint (at the step reached) and one adapter, from rank 0
    assert _kinds(stopped)[-3:] == ["checkpoint", "adapter", "state"]
    assert stopped[-1]["state"] == {"state": "INTERRUPTED", "message": f"stopped at step {stop_step}"}
    ckpt = stopped[-3]["checkpoint"]
    assert ckpt["step"] == stop_step and steps == list(range(1, stop_step + 1))

    resumed_spec = _spec("job-resumed", batch_size=1)
    resumed_spec["config"].update(max_steps=stop_step + 2, checkpoint_every_steps=0)
    resumed_spec["resume_from"] = _key(ckpt["artifact"])  # a store key: the job tenant's id space
    proc = _launch(tmp, model_root, "job-resumed", batch_size=1, nproc=2, spec=resumed_spec)
    _finish(proc, tmp, "job-resumed", timeout=300)
    resumed = _events(tmp, "job-resumed")
    assert [e["step"]["step"] for e in resumed if e["step"]] == [stop_step + 1, stop_step + 2]
    assert resumed[-1]["state"]["state"] == "SUCCEEDED"


def _service_config(**overrides):
    from strop.common.trainer_types import TrainConfig, TrainMethod

    settings = {**_spec("", batch_size=1)["config"], "method": TrainMethod.SFT, "num_devices": 2, **overrides}
    return TrainConfig(**settings)


@pytest.fixture
def ddp_session(client, runs):
    from strop.client import LoraConfig, Quantization

    tmp, _, _ = runs
    s = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32", max_seq_length=64)
    client.attach_lora(s.session_id, LoraConfig(**LORA))
    ds = client.upload_dataset((tmp / "data" / "tokens.jsonl").read_bytes(), name="tokens.jsonl")
    yield s.session_id, ds.dataset_id
    client.close_session(s.session_id)


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_the_service_runs_a_num_devices_job_on_torchrun_ranks_and_the_session_holds_what_they_trained(
    client, trainer, runs, ddp_session, parallelism
):
    from safetensors.torch import load_file

    from strop.common.artifacts import ArtifactStore
    from strop.common.trainer_types import Parallelism

    tmp, config, _ = runs
    session_id, dataset_id = ddp_session
    cfg = _service_config(parallelism=Parallelism(parallelism))
    events = list(client.train(session_id, dataset_id, cfg))
    crash = next(
        (name for name in CRASH_SIGNALS.values() if f"exited with {name}" in events[-1].state.message), None
    )
    ckpt = client.get_job(events[0].job_id).last_checkpoint
    if events[-1].state.state.value == "INTERRUPTED" and crash and ckpt is not None:
        # a rank's native crash (seen once in CI: SIGABRT, cause unknown; the service logs the launcher's last lines):
        # the job resumes from its checkpoint once, as a user would, and must then finish
        import warnings

        warnings.warn(f"{parallelism}: {events[-1].state.message}; resumed once", stacklevel=1)
        done = [e for e in events if e.step and e.step.step <= ckpt.step]
        events = done + list(client.train(session_id, dataset_id, cfg, resume_from_job_id=events[0].job_id))
    assert events[-1].state.state.value == "SUCCEEDED", events[-1].state.message
    losses = [e.step.loss for e in events if e.step]
    reference = [e["step"]["loss"] for e in _events(tmp, "job-one") if e["step"]]
    loss_bound, _ = _bounds(config)
    assert len(losses) == STEPS  # rank 0's, once each
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)) <= loss_bound
    job = client.list_jobs(session_id)[-1]
    assert job.state.value == "SUCCEEDED" and job.step == STEPS and job.last_checkpoint.step == STEPS
    assert job.adapter.metadata["world_size"] == "2"
    # the session now holds rank 0's adapter: what SaveAdapter writes is what the ranks trained, bit for bit
    saved = client.save_adapter(session_id)
    store = ArtifactStore(trainer[2].artifact_root)
    ranks = load_file(str(store.path_of(job.adapter.artifact_id) / "adapter_model.safetensors"))
    session = load_file(str(store.path_of(saved.artifact_id) / "adapter_model.safetensors"))
    assert sorted(ranks) == sorted(session) and all(bool((ranks[k] == session[k]).all()) for k in ranks)


def test_cancelling_a_num_devices_job_stops_every_rank_with_a_checkpoint(client, ddp_session):
    import psutil

    session_id, dataset_id = ddp_session
    stream = client.train(session_id, dataset_id, _service_config(max_steps=10_000, checkpoint_every_steps=0))
    for event in stream:
        if event.step:
            client.cancel_job(event.job_id)
            break
    stream.close()  # detach; the job goes on to its end
    job = client.wait_job(event.job_id, timeout=180)
    assert job.state.value == "CANCELLED", job.error
    assert job.last_checkpoint is not None and job.last_checkpoint.step == job.step > 0
    # every rank (and torchrun) has exited: none is left training, or waiting in an all-reduce
    workers = [
        p for p in psutil.Process().children(recursive=True) if "strop.trainer_svc.dist_worker" in p.cmdline()
    ]
    assert workers == []


def test_a_job_asking_for_more_devices_than_the_node_has_is_refused_before_it_starts(client, ddp_session):
    from strop.client import FailedPreconditionError, InvalidArgumentError

    session_id, dataset_id = ddp_session
    cores = os.cpu_count()
    with pytest.raises(
        FailedPreconditionError, match=f"num_devices {cores + 1}: this trainer has {cores} CPU cores"
    ):
        list(client.train(session_id, dataset_id, _service_config(num_devices=cores + 1)))
    with pytest.raises(InvalidArgumentError, match=r"num_devices must be in 0\.\.1024, got -1"):
        list(client.train(session_id, dataset_id, _service_config(num_devices=-1)))
    with pytest.raises(
        FailedPreconditionError, match="num_nodes 2: the trainer service trains on its own node"
    ):
        list(client.train(session_id, dataset_id, _service_config(num_nodes=2, num_devices=1)))
    with pytest.raises(InvalidArgumentError, match=r"num_nodes must be in 0\.\.1024, got -3"):
        list(client.train(session_id, dataset_id, _service_config(num_nodes=-3)))
    assert client.list_jobs(session_id) == []  # nothing was created


def test_ranks_refuse_a_world_other_than_the_one_the_job_declares(runs, model_root):
    """A job's global batch is batch_size x its processes, so a spec that declares num_nodes x num_devices must
    train in exactly that world: one process started with a spec of 2 devices (an operator's manifest that
    disagrees with its job) fails before it loads anything, with both numbers."""
    tmp, _, _ = runs
    spec = _spec("job-wrong-world", 1)
    spec["config"].update(num_nodes=2, num_devices=1)
    proc = _launch(tmp, model_root, "job-wrong-world", batch_size=1, nproc=1, spec=spec)
    assert proc.wait(timeout=120) != 0
    (failed,) = [
        e["state"] for e in _events(tmp, "job-wrong-world") if e["state"] and e["state"]["state"] == "FAILED"
    ]
    assert "declares 2 processes (num_nodes 2 x num_devices 1) but 1 joined" in failed["message"], failed


def test_ranks_notice_when_the_service_that_launched_them_is_gone():
    import subprocess

    from strop.trainer_svc.dist_worker import launcher_gone

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert launcher_gone({"STROP_LAUNCHER_PID": str(dead.pid)})
    assert not launcher_gone({"STROP_LAUNCHER_PID": str(os.getpid())})
    assert not launcher_gone({})  # started by an operator or torchrun: no launcher to watch


def _rank_process(rank: int):
    """The service's dist_worker process of ``rank`` (torchrun's child, under this test's trainer service)."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        try:
            if "strop.trainer_svc.dist_worker" in p.cmdline() and p.environ().get("RANK") == str(rank):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def _workers() -> list:
    """The dist_worker processes still alive under this test (one exiting meanwhile, or a zombie, holds nothing)."""
    import psutil

    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "strop.trainer_svc.dist_worker" in p.cmdline():
                alive.append(p)
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
    return alive


# torchrun notices a rank's exit within its 0.1 s monitor interval and SIGTERMs the rest, SIGKILLing them 30 s
# later; rank 0's next collective fails at once (the killed rank's sockets closed). 60 s is that worst case, twice.
LOST_RANK_SECONDS = 60.0


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_a_sigkilled_rank_ends_the_job_interrupted_at_its_last_checkpoint_and_it_resumes(
    client, trainer, ddp_session, parallelism
):
    import signal
    import time

    from safetensors.torch import load_file

    from strop.common.artifacts import ArtifactStore
    from strop.common.trainer_types import Parallelism

    session_id, dataset_id = ddp_session
    split = Parallelism(parallelism)
    stream = client.train(
        session_id, dataset_id, _service_config(max_steps=10_000, checkpoint_every_steps=2, parallelism=split)
    )
    for event in stream:
        if event.checkpoint:
            break
    rank1 = _rank_process(1)
    assert rank1 is not None
    rank1.send_signal(signal.SIGKILL)  # what the OOM killer does: no handler runs, nothing is saved
    killed_at = time.monotonic()
    stream.close()
    job = client.wait_job(event.job_id, timeout=120)
    took = time.monotonic() - killed_at
    assert took < LOST_RANK_SECONDS, took
    # not FAILED (nothing in the job is wrong; it resumes) and never SUCCEEDED: INTERRUPTED, no error code
    assert job.state.value == "INTERRUPTED" and job.error == "" and job.error_code == "", job
    ckpt = job.last_checkpoint
    assert ckpt is not None and 2 <= ckpt.step <= job.step and ckpt.step % 2 == 0, job
    (end,) = [
        e.state for e in client.watch_job(job.job_id) if e.state and e.state.state.value == "INTERRUPTED"
    ]
    assert end.message == (
        f"rank 1 exited with SIGKILL at step {job.step}; resume from the checkpoint at step {ckpt.step}"
    )
    assert _workers() == []  # torchrun stopped rank 0 too: nothing holds the devices
    store = ArtifactStore(trainer[2].artifact_root)
    store.verify(ckpt.artifact.artifact_id)  # intact: every file's sha256 as published
    # the session holds the checkpoint's adapter (what a resume continues from), bit for bit
    saved = client.save_adapter(session_id)
    at_ckpt = load_file(str(store.path_of(ckpt.artifact.artifact_id) / "adapter_model.safetensors"))
    session = load_file(str(store.path_of(saved.artifact_id) / "adapter_model.safetensors"))
    assert sorted(at_ckpt) == sorted(session) and all(bool((at_ckpt[k] == session[k]).all()) for k in session)

    config = _service_config(max_steps=ckpt.step + 2, checkpoint_every_steps=0, parallelism=split)
    resumed = list(client.train(session_id, dataset_id, config, resume_from_job_id=job.job_id))
    assert [e.step.step for e in resumed if e.step] == [ckpt.step + 1, ckpt.step + 2], resumed[-1].state
    assert client.get_job(resumed[0].job_id).state.value == "SUCCEEDED"


# Rank 1 alone fails inside its 2nd training step, as a rank that alone sees a bad row would: the hook is
# installed by a sitecustomize on PYTHONPATH, which the service's torchrun and ranks inherit.
_FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    import transformers
    from strop.common.errors import InvalidArgument

    step = transformers.Trainer.training_step
    calls = []

    def training_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise InvalidArgument("row 3 of this rank's batch is bad")
        return step(self, *args, **kwargs)

    transformers.Trainer.training_step = training_step
"""


def test_a_rank_whose_training_fails_fails_the_job_with_that_ranks_message_and_code(
    client, ddp_session, monkeypatch, tmp_path
):
    session_id, dataset_id = ddp_session
    (tmp_path / "sitecustomize.py").write_text(_FAIL_ON_RANK_1)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    events = list(client.train(session_id, dataset_id, _service_config()))
    job = client.get_job(events[0].job_id)
    # rank 0's own error (its collective failing when rank 1 exited) is a consequence, not the job's error
    assert job.state.value == "FAILED", job
    assert job.error == "rank 1: InvalidArgument: row 3 of this rank's batch is bad"
    assert job.error_code == "INVALID_ARGUMENT"
    assert [e.step.step for e in events if e.step] == [1]  # rank 0 logged step 1; step 2 never completed
    assert _workers() == []


def test_fsdp2_losses_and_adapter_equal_one_process_on_the_global_batch(runs, model_root):
    """FSDP2 over 2 gloo ranks against the same one-process run (``runs``' job-one) as DDP, with the same bounds:
    the frozen base and the adapters are sharded, so each forward all-gathers each layer's weights (exact copies)
    and each backward reduce-scatters the gradients (one fp32 rounding an element, as DDP's all-reduce), the rest
    is the same fp32 function summed in another order. A rank training its own shard unsynchronised, or a rank 0
    that wrote its shard instead of the whole tensor, is off by O(1) (or has the wrong shapes)."""
    import torch

    tmp, config, initial = runs
    spec = _spec("job-fsdp", batch_size=1)
    spec["config"].update(parallelism="FSDP", num_devices=2)
    proc = _launch(tmp, model_root, "job-fsdp", batch_size=1, nproc=2, spec=spec)
    _finish(proc, tmp, "job-fsdp", timeout=300)
    one, fsdp = _events(tmp, "job-one"), _events(tmp, "job-fsdp")
    assert fsdp[1]["log"]["message"].startswith(
        f"FSDP2 over 2 processes shards the frozen base and {len(initial)}"
    )
    loss_bound, update_bound = _bounds(config)
    losses_one = [e["step"]["loss"] for e in one if e["step"]]
    losses_fsdp = [e["step"]["loss"] for e in fsdp if e["step"]]
    assert len(losses_fsdp) == STEPS
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses_fsdp, losses_one, strict=True))
    assert worst_loss <= loss_bound, (losses_fsdp, losses_one, loss_bound)

    adapter_one, meta_one = _adapter(tmp, one)
    adapter_fsdp, meta_fsdp = _adapter(tmp, fsdp)
    # the single-process format: the same names, whole shapes and dtypes (rank 0 gathered every shard)
    assert {k: (v.shape, v.dtype) for k, v in adapter_fsdp.items()} == {
        k: (v.shape, v.dtype) for k, v in adapter_one.items()
    }
    assert meta_fsdp == {**meta_one, "job_id": "job-fsdp", "world_size": "2"}

    def norm(tensors) -> float:
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))

    update = norm(adapter_one[n] - initial[n] for n in initial)
    delta = norm(adapter_fsdp[n] - adapter_one[n] for n in initial)
    assert update > 0.01 * norm(initial.values()), (update, norm(initial.values()))
    assert delta / update <= update_bound, (delta / update, update_bound)
    # checkpoints too hold the whole adapter (and FSDP's resume state, adapter-sized: never the base)
    from safetensors.torch import load_file

    from strop.common.artifacts import ArtifactStore

    store = ArtifactStore(tmp / "artifacts")
    (last,) = [e["checkpoint"] for e in fsdp if e["checkpoint"] and e["checkpoint"]["step"] == STEPS]
    ckpt_dir = store.path_of(_key(last["artifact"]))
    ckpt = load_file(str(ckpt_dir / "adapter_model.safetensors"))
    assert sorted(ckpt) == sorted(adapter_fsdp) and all(
        bool((ckpt[k] == adapter_fsdp[k]).all()) for k in ckpt
    )
    base_bytes = (model_root / "tiny-llama" / "model.safetensors").stat().st_size
    assert all(f.stat().st_size < base_bytes / 4 for f in ckpt_dir.iterdir())
    assert (ckpt_dir / "pytorch_model_fsdp.bin").is_file()  # written by transformers' FSDP path only


def test_fsdp2_shards_a_4bit_base_and_trains_what_one_process_trains(runs, model_root):
    """A prequantized NF4 base (``tiny-llama-4bit``, double quant, its other weights saved in bf16 and loaded in the
    session's fp32) under FSDP2 over 2 gloo ranks against one process of the global batch, with the bounds of the
    16-bit case: the codes are relabelled as fp32 words (``fsdp.shard_4bit_as_compute_dtype``), sharded and
    gathered as bytes, so each rank dequantizes exactly the weights one process does, and the rest is the same fp32
    function summed in another order. Each rank must hold about half the base, the 4-bit codes included
    (accelerate leaves uint8 codes out of the sharding: every rank would hold them whole, 74% of this base), and
    the adapter's metadata must describe the base as loaded (its codes' digest read before sharding).

    This test found that the 4-bit session computed in bf16: transformers kept the checkpoint's bf16 norms and
    embeddings (``models.compute_prequantized_in``); the adapters of batch 2 in one process and of 2 ranks of
    batch 1 were then 0.2% apart, bf16 rounding of differently summed gradients."""
    import torch

    tmp, config, initial = runs
    specs = {"job-one-4bit": _spec("job-one-4bit", 2), "job-fsdp-4bit": _spec("job-fsdp-4bit", 1)}
    for spec in specs.values():
        spec["model"].update(model_path="tiny-llama-4bit", quantization="UNSPECIFIED")
    specs["job-fsdp-4bit"]["config"].update(parallelism="FSDP", num_devices=2)
    procs = {
        job: _launch(
            tmp,
            model_root,
            job,
            batch_size=spec["config"]["batch_size"],
            nproc=3 - spec["config"]["batch_size"],
            spec=spec,
        )
        for job, spec in specs.items()
    }
    for job, proc in procs.items():
        _finish(proc, tmp, job, timeout=300)
    one, fsdp = _events(tmp, "job-one-4bit"), _events(tmp, "job-fsdp-4bit")
    (held,) = [
        e["log"]["message"] for e in fsdp if e["log"] and e["log"]["message"].startswith("FSDP2: this rank")
    ]
    mine, whole = (int(x.replace(",", "")) for x in re.findall(r"[\d,]+(?= of| bytes)", held))
    # 2 ranks: half of every tensor, each dim 0 padded to an even length at most
    assert whole > 0 and mine <= 0.5 * whole + 4 * config["vocab_size"], held
    loss_bound, update_bound = _bounds(config)
    losses_one = [e["step"]["loss"] for e in one if e["step"]]
    losses_fsdp = [e["step"]["loss"] for e in fsdp if e["step"]]
    assert len(losses_fsdp) == len(losses_one) == STEPS
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses_fsdp, losses_one, strict=True))
    assert worst_loss <= loss_bound, (losses_fsdp, losses_one, loss_bound)
    adapter_one, meta_one = _adapter(tmp, one)
    adapter_fsdp, meta_fsdp = _adapter(tmp, fsdp)
    assert meta_fsdp == {**meta_one, "job_id": "job-fsdp-4bit", "world_size": "2"}
    assert meta_one["base_quant.quant_storage"] == "uint8" and meta_one["base_quant.digest"]

    def norm(tensors) -> float:
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))

    names = sorted(adapter_one)
    assert names == sorted(initial)
    update = norm(adapter_one[n] - initial[n] for n in names)
    delta = norm(adapter_fsdp[n] - adapter_one[n] for n in names)
    assert update > 0.01 * norm(initial.values()), (update, norm(initial.values()))
    assert delta / update <= update_bound, (delta / update, update_bound)


def test_fsdp_is_refused_on_one_device_before_the_job_starts(client, ddp_session):
    from strop.client import InvalidArgumentError, Parallelism

    session_id, dataset_id = ddp_session
    with pytest.raises(InvalidArgumentError, match="parallelism FSDP shards the base over num_devices > 1"):
        list(
            client.train(session_id, dataset_id, _service_config(parallelism=Parallelism.FSDP, num_devices=1))
        )
    assert client.list_jobs(session_id) == []  # nothing was created


def test_fsdp_jobs_gather_parameters_as_stored_where_accelerate_would_cast_them_to_bf16():
    """What a bf16 FSDP job on GPUs gets from accelerate (its policy for ``mixed_precision="bf16"``) and what
    ``fsdp.gather_as_stored`` makes of it before training shards the model: no cast, so the fp32 adapters train
    under autocast and reduce in fp32 as in one process (the H200 check of the difference is in
    ``tests/kernels/models/test_fsdp_nf4.py``). The CPU tier's FSDP jobs run without mixed precision, where both agree."""
    import types

    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    from strop.trainer_svc.core import fsdp

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16  # accelerate's, for a bf16 job
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))
    )
    assert fsdp.gather_as_stored(trainer)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, None, None)
    assert not fsdp.gather_as_stored(types.SimpleNamespace(accelerator=types.SimpleNamespace(state=object())))


def test_sharded_jobs_on_accelerators_stage_the_base_in_host_memory_and_admission_counts_what_fsdp_will_place(
    model_root,
):
    """Where a rank loads the base (``fsdp.staging_device``): host memory for an FSDP job on several accelerators,
    so the base need not fit one device (FSDP2 moves each layer there as it shards it: the H200 check is in
    ``tests/kernels/models/test_fsdp_nf4.py``); the rank's device otherwise. Admission must count what the sharding will
    place on the device before it is there: 1/N of every parameter plus two layers gathered whole."""
    from strop.common.trainer_types import (
        LoadModelRequest,
        LoraConfig,
        Parallelism,
        Quantization,
        TrainConfig,
    )
    from strop.trainer_svc.core import fsdp, model_loading

    sharded = TrainConfig(parallelism=Parallelism.FSDP, num_devices=4)
    assert fsdp.staging_device(sharded, "cuda:1", 4) == "cpu"
    assert fsdp.staging_device(sharded, "cpu", 4) == "cpu"
    assert (
        fsdp.staging_device(TrainConfig(num_devices=4), "cuda:1", 4) == "cuda:1"
    )  # DDP: a whole copy a device
    assert fsdp.staging_device(sharded, "cuda:0", 1) == "cuda:0"

    req = LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE, dtype="float32")
    loaded = model_loading.load_model(req, model_root=model_root, device="cpu", load_device="cpu")
    model_loading.attach_lora(loaded, LoraConfig(**LORA))
    params = list(loaded.model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    layer = sum(
        p.numel() * p.element_size() for p in loaded.model.get_base_model().model.layers[0].parameters()
    )
    assert fsdp.device_bytes_after_sharding(loaded.model, 4) == -(-total // 4) + 2 * layer
    assert fsdp.device_bytes_after_sharding(loaded.model, 1) == total + 2 * layer


def test_the_lost_rank_is_named_even_when_torchrun_names_the_rank_that_exited_because_of_it(tmp_path):
    """torchrun's root cause is its earliest failure by a timestamp in whole seconds, the lower rank on a tie: when
    rank 0 notices the lost peer in a collective (FSDP's all-gathers, every layer) and exits ``EXIT_LOST_PEER``
    before torchrun's next poll, the two exits are seen in one poll and rank 0 is named. The summaries here are
    torchrun's own (``ChildFailedError``), for both orders and for a stop that lost no rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from strop.trainer_svc.core.dist_launch import EXIT_LOST_PEER, lost_rank_summary

    def summary(*exits: tuple[int, int]) -> str:
        failures = {
            rank: ProcessFailure(
                local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(tmp_path / "none")
            )
            for rank, code in exits
        }
        for failure in failures.values():
            failure.timestamp = 1_700_000_000  # one second, as when one poll sees both exits
        return (
            "INFO torchrun's own log lines\n"
            + ChildFailedError("strop.trainer_svc.dist_worker", failures).format_msg()
        )

    seen_together = summary((0, EXIT_LOST_PEER), (1, -9))
    assert "Root Cause" in seen_together and seen_together.index("rank      : 0") > seen_together.index(
        "Root Cause"
    )
    assert lost_rank_summary(seen_together) == "rank 1 exited with SIGKILL"
    assert lost_rank_summary(summary((1, -9), (0, -15))) == "rank 1 exited with SIGKILL"  # rank 1 seen first
    assert lost_rank_summary(summary((1, 1), (0, EXIT_LOST_PEER))) == "rank 1 exited with status 1"
    # only consequences: torchrun's root cause stands
    assert (
        lost_rank_summary(summary((0, EXIT_LOST_PEER), (1, -15)))
        == f"rank 0 exited with status {EXIT_LOST_PEER}"
    )
    assert (
        lost_rank_summary("torchrun exited before any rank started")
        == "a rank exited without a failure of its own"
    )
