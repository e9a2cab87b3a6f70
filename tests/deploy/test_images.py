"""The Containerfiles and the lock subsets they install, checked without building (``make test-deploy`` builds)."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# deploy/ is not a package (the builder stage runs the script with a bare python3): load it from its path
_spec = importlib.util.spec_from_file_location("deploy_lock_subset", ROOT / "deploy" / "lock_subset.py")
lock_subset = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(lock_subset)
parse_lock, seeds, select = lock_subset.parse_lock, lock_subset.seeds, lock_subset.select
LOCK = ROOT / "requirements" / "lock.txt"
GPU_LOCK = ROOT / "requirements" / "gpu-lock.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONTAINERFILES = {
    "export": ROOT / "deploy" / "Containerfile.export",
    "trainer": ROOT / "deploy" / "Containerfile.trainer",
}
# Build tools that must not reach a final stage (the trainer's gcc is Triton's run-time need, see its Containerfile).
BUILD_TOOLS = ("build-essential", "cmake", "g++", "make ", "git", "python3-dev")


def names(extras: list[str], *, torch: bool = True) -> set[str]:
    pins = parse_lock(LOCK.read_text())
    return {p.name for p in select(pins, seeds(PYPROJECT, extras), ("torch",) if torch else ())}


def stages(text: str) -> list[str]:
    return re.split(r"^FROM ", text, flags=re.M)[1:]


def test_sdk_install_stays_torch_free():
    sdk = names([], torch=False)
    assert {"grpcio", "protobuf"} <= sdk
    heavy = {"torch", "triton", "transformers", "peft", "trl", "bitsandbytes", "numpy", "llama-cpp-python"}
    assert sdk & heavy == set(), f"`pip install strop` would pull {sdk & heavy}"


def test_export_image_installs_the_export_role_and_no_dev_or_gpu_tools():
    export = names(["export"])
    assert {
        "transformers",
        "peft",
        "gguf",
        "llama-cpp-python",
        "bitsandbytes",
        "grpcio-health-checking",
    } <= export
    assert export & {"pytest", "ruff", "grpcio-tools", "triton", "trl", "kubernetes-validate"} == set()


def test_trainer_image_installs_the_train_role_with_the_kernels():
    train = names(["train"])
    assert {"triton", "trl", "peft", "bitsandbytes", "datasets", "accelerate", "matplotlib"} <= train
    assert train & {"pytest", "ruff", "grpcio-tools", "llama-cpp-python", "gguf"} == set()


def test_dev_subset_is_the_whole_lock():
    # the lock is compiled for the dev extra: walking its `via` graph from there must reach every pin, or the
    # walk misses edges (and an image would miss a dependency until `pip check` failed in its build)
    assert names(["dev"]) == set(parse_lock(LOCK.read_text()))


def test_every_selected_pin_keeps_its_hashes():
    pins = parse_lock(LOCK.read_text())
    for pin in select(pins, seeds(PYPROJECT, ["train", "export"])):
        assert re.match(rf"^{re.escape(pin.lines[0].split('==')[0])}==\S+ \\$", pin.lines[0]), pin.lines[0]
        assert any("--hash=sha256:" in line for line in pin.lines[1:]), f"{pin.name} lost its hashes"


def test_an_unknown_extra_is_refused():
    with pytest.raises(ValueError, match="expected one of the extras"):
        seeds(PYPROJECT, ["exprot"])


@pytest.mark.parametrize("role", sorted(CONTAINERFILES))
def test_containerfile_is_multi_stage_from_a_public_base_argument(role):
    text = CONTAINERFILES[role].read_text()
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, flags=re.M)
    assert default and re.match(r"^docker\.io/[\w.-]+/[\w.-]+:[\w.-]+$", default.group(1)), (
        "a public default base"
    )
    assert re.findall(r"^FROM (\S+)", text, flags=re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    builder, final = stages(text)
    assert builder.startswith("${BASE_IMAGE} AS builder")
    assert "COPY --from=builder /opt/strop /opt/strop" in final


@pytest.mark.parametrize("role", sorted(CONTAINERFILES))
def test_containerfile_installs_from_the_lock_by_hash(role):
    builder, _ = stages(CONTAINERFILES[role].read_text())
    extra = {"export": "export", "trainer": "train"}[role]
    assert f"deploy/lock_subset.py requirements/lock.txt pyproject.toml --extra {extra}" in builder
    assert "pip install -q --no-deps --require-hashes -r" in builder
    assert "pip check" in builder
    assert (
        'pip install -q --no-deps ${TORCH_PIP_ARGS} "${TORCH_SPEC}"' in builder
    )  # torch chosen apart, as make setup (the CPU builds)


def pins_of(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", path.read_text(), flags=re.M))


def test_cuda_trainer_builds_by_default_from_its_whole_lock_by_hash():
    text = CONTAINERFILES["trainer"].read_text()
    builder, final = stages(text)
    # the default build: every pin of the GPU lock by hash, torch and its CUDA wheels included, nothing resolved
    (lock,) = re.findall(r"^ARG TRAIN_LOCK=(\S+)$", text, flags=re.M)
    assert (ROOT / lock) == GPU_LOCK and GPU_LOCK.exists()
    assert 'pip install -q --no-deps --require-hashes -r "${TRAIN_LOCK}"' in builder
    # a Debian bookworm base, whose python3 (3.11) is the Python the lock was compiled with; no CUDA base image:
    # the CUDA libraries come as torch's wheels
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, flags=re.M)
    assert base == "docker.io/library/debian:bookworm-slim"
    assert "autogenerated by pip-compile with Python 3.11" in GPU_LOCK.read_text()
    # the NVIDIA container toolkit refuses a node whose driver cannot run the wheels' CUDA
    assert (
        'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in final and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in final
    )
    assert "TRITON_HOME=/tmp/" in final, "Triton's home under the writable /tmp (HOME is read-only in a pod)"


def test_gpu_lock_hashes_every_wheel_and_agrees_with_the_cpu_lock():
    text = GPU_LOCK.read_text()
    blocks = [b for b in re.split(r"\n(?=[A-Za-z0-9])", text) if re.match(r"^[A-Za-z0-9_.-]+==", b)]
    gpu, cpu = pins_of(GPU_LOCK), pins_of(LOCK)
    assert len(blocks) == len(gpu)
    assert [b.split("==")[0] for b in blocks if "--hash=sha256:" not in b] == [], "every pin needs its hashes"
    # nothing but pins: strop itself (pip-compile's "unsafe" `strop @ file://…`) is installed from the context
    requirement_lines = [ln for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert all(re.match(r"^[A-Za-z0-9_.-]+==\S+ \\$", ln) for ln in requirement_lines), requirement_lines[-3:]
    # the H200 image's torch (requirements/gpu.txt), PyPI's CUDA 13.0 build: its CUDA wheels are pinned too
    assert f"torch=={gpu['torch']}" in (ROOT / "requirements" / "gpu.txt").read_text()
    assert gpu["cuda-toolkit"].startswith("13.0.") and {
        "nvidia-cublas",
        "nvidia-cudnn-cu13",
        "nvidia-nccl-cu13",
    } <= set(gpu)
    # the same versions as lock.txt wherever both pin a package, but setuptools (torch 2.11 wants it below 82)
    differ = {n: (v, cpu[n]) for n, v in gpu.items() if n in cpu and cpu[n] != v}
    assert set(differ) <= {"setuptools"}, differ
    # the train role and nothing of the export role or the dev tools
    assert {"triton", "trl", "peft", "bitsandbytes", "transformers"} <= set(gpu)
    assert set(gpu) & {"llama-cpp-python", "gguf", "pytest", "ruff", "kubernetes-validate"} == set()


@pytest.mark.parametrize("role", sorted(CONTAINERFILES))
def test_final_stage_runs_a_console_script_as_a_numeric_non_root_user_without_build_tools(role):
    _, final = stages(CONTAINERFILES[role].read_text())
    user = re.findall(r"^USER (\d+):(\d+)$", final, flags=re.M)
    assert user and user[-1] != ("0", "0"), "expected a numeric non-root USER"
    (entry,) = re.findall(r'^ENTRYPOINT \["/opt/strop/bin/([\w-]+)"\]$', final, flags=re.M)
    assert entry == f"strop-{role}" and entry in PYPROJECT["project"]["scripts"]
    installs = " ".join(re.findall(r"apt-get install[^;]*", final))
    assert not [t for t in BUILD_TOOLS if t in installs + " "], (
        f"{role}: build tools in the final stage: {installs}"
    )
    if role == "export":
        assert "gcc" not in final.split("ENV ")[0], "the export image needs no compiler at all"
