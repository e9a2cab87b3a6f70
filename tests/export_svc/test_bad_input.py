"""Bad input is refused with a precise error (and its gRPC status) before anything is written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from strop.common import errors
from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
from strop.export_svc.core.pipeline import run_export

from .conftest import make_random_adapter, store_is_empty


@dataclass
class Case:
    """A bad request: what to build, what it asks, the expected status and message."""

    build: Callable[[Path, Path], ExportRequest]  # (source models, scratch model root) -> request
    code: str
    match: str


def _copy(src: Path, root: Path, name: str) -> Path:
    shutil.copytree(src / name, root / name)
    return root / name


def _targets(*specs: ExportTarget) -> list[ExportTarget]:
    return list(specs) or [ExportTarget.gguf("F16"), ExportTarget.merged()]


def _arch_mismatch(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    _copy(models, root, "qwen2-bpe")
    make_random_adapter(root / "qwen2-bpe", root / "qwen2-lora")  # records qwen2-bpe as its base
    return ExportRequest(targets=_targets(), adapter_path="qwen2-lora", base_model_path="llama-bpe")


def _shape_mismatch(models: Path, root: Path) -> ExportRequest:
    from strop.fixtures import TinyShape, make_tiny_model

    _copy(models, root, "llama-bpe")
    make_tiny_model(
        root / "narrow",
        arch="llama",
        shape=TinyShape(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1),
    )
    make_random_adapter(root / "narrow", root / "narrow-lora")
    cfg = json.loads((root / "narrow-lora" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = ""  # nothing recorded: only the tensor shapes can tell
    (root / "narrow-lora" / "adapter_config.json").write_text(json.dumps(cfg))
    return ExportRequest(targets=_targets(), adapter_path="narrow-lora", base_model_path="llama-bpe")


def _unknown_ftype(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    return ExportRequest(targets=[ExportTarget.gguf("Q4_K_XL")], base_model_path="llama-bpe")


def _unknown_dtype(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    return ExportRequest(targets=[ExportTarget.merged("float8")], base_model_path="llama-bpe")


def _unspecified_kind(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    return ExportRequest(targets=[ExportTarget(gguf_type="F16")], base_model_path="llama-bpe")


def _missing_tokenizer(models: Path, root: Path) -> ExportRequest:
    base = _copy(models, root, "llama-bpe")
    for p in base.glob("tokenizer*"):
        p.unlink()
    _copy(models, root, "llama-bpe-lora")  # a random adapter saved without tokenizer files
    return ExportRequest(targets=_targets(), adapter_path="llama-bpe-lora", base_model_path="llama-bpe")


def _truncated_base(models: Path, root: Path) -> ExportRequest:
    base = _copy(models, root, "llama-bpe")
    f = base / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return ExportRequest(targets=_targets(), base_model_path="llama-bpe")


def _truncated_adapter(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    a = _copy(models, root, "llama-bpe-lora")
    f = a / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    return ExportRequest(targets=_targets(), adapter_path="llama-bpe-lora", base_model_path="llama-bpe")


def _outside_root(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    return ExportRequest(
        targets=_targets(), adapter_path=str(models / "llama-bpe-lora"), base_model_path="llama-bpe"
    )


def _dotdot_path(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    return ExportRequest(targets=_targets(), base_model_path="../llama-bpe")


def _unsupported_arch(models: Path, root: Path) -> ExportRequest:
    base = _copy(models, root, "llama-bpe")
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(model_type="phi3", architectures=["Phi3ForCausalLM"])
    (base / "config.json").write_text(json.dumps(cfg))
    return ExportRequest(targets=_targets(), base_model_path="llama-bpe")


def _pickle_only(models: Path, root: Path) -> ExportRequest:
    base = _copy(models, root, "llama-bpe")
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    return ExportRequest(targets=_targets(), base_model_path="llama-bpe")


def _dora_to_vllm(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe")
    make_random_adapter(root / "llama-bpe", root / "dora", use_dora=True, target_modules=["q_proj", "v_proj"])
    return ExportRequest(targets=[ExportTarget.merged(), ExportTarget.peft()], adapter_path="dora")


def _unresolvable_base(models: Path, root: Path) -> ExportRequest:
    _copy(models, root, "llama-bpe-lora")  # records a base outside this model root
    return ExportRequest(targets=_targets(), adapter_path="llama-bpe-lora")


CASES = {
    "adapter_of_another_arch": Case(
        _arch_mismatch, "INVALID_ARGUMENT", r"trained on 'qwen2-bpe'.*model_type 'qwen2' vs 'llama'"
    ),
    "adapter_of_other_shapes": Case(
        _shape_mismatch,
        "INVALID_ARGUMENT",
        r"does not fit base 'llama-bpe'.*mlp.down_proj.*need a base weight of \[128, 256\], base has \[256, 512\]",
    ),
    "unknown_gguf_type": Case(
        _unknown_ftype, "INVALID_ARGUMENT", r"unknown GGUF type 'Q4_K_XL'; valid: .*Q4_K_M.*Q6_K"
    ),
    "unknown_dtype": Case(
        _unknown_dtype,
        "INVALID_ARGUMENT",
        r"unknown dtype 'float8'; valid: \['bfloat16', 'float16', 'float32'\]",
    ),
    "unspecified_target_kind": Case(
        _unspecified_kind,
        "INVALID_ARGUMENT",
        r"unknown target kind 'UNSPECIFIED'; valid: \['MERGED_SAFETENSORS', 'PEFT_ADAPTER', 'GGUF', 'GGUF_LORA'\]",
    ),
    "missing_tokenizer": Case(
        _missing_tokenizer, "FAILED_PRECONDITION", r"no tokenizer: neither adapter 'llama-bpe-lora' nor base"
    ),
    "truncated_base_safetensors": Case(
        _truncated_base, "INVALID_ARGUMENT", r"'llama-bpe/model.safetensors' is truncated"
    ),
    "truncated_adapter_safetensors": Case(
        _truncated_adapter, "INVALID_ARGUMENT", r"'llama-bpe-lora/adapter_model.safetensors' is truncated"
    ),
    "path_outside_the_roots": Case(
        _outside_root, "INVALID_ARGUMENT", r"adapter path .* is outside the allowed roots"
    ),
    "dotdot_path": Case(
        _dotdot_path, "INVALID_ARGUMENT", r"base path '\.\./llama-bpe' is outside the allowed root"
    ),
    "unsupported_arch": Case(
        _unsupported_arch,
        "UNIMPLEMENTED",
        r"architecture 'phi3' .* not supported for export; supported: "
        r"\['gemma2', 'gemma3_text', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]",
    ),
    "pickle_weights_only": Case(_pickle_only, "INVALID_ARGUMENT", r"only pickle weights .*safetensors only"),
    "dora_adapter_to_vllm_lora": Case(
        _dora_to_vllm, "FAILED_PRECONDITION", r"cannot be a vLLM LoRA adapter: it uses DoRA"
    ),
    "adapter_base_not_under_the_root": Case(
        _unresolvable_base,
        "FAILED_PRECONDITION",
        r"cannot resolve the base of adapter 'llama-bpe-lora'.*pass base_model_path",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_precisely_and_writes_nothing(export_models, store, tmp_path, name):
    case = CASES[name]
    root = tmp_path / "models"
    root.mkdir()
    req = case.build(export_models, root)
    req.verify = VerifyOptions(skip=True)
    with pytest.raises(Exception) as info:
        run_export(req, model_root=root, store=store)
    exc = info.value
    assert getattr(exc, "grpc_code", None) == case.code, (
        f"{name}: {type(exc).__name__} ({getattr(exc, 'grpc_code', '?')}): {exc}"
    )
    assert info.match(case.match)
    assert store_is_empty(store), f"{name}: something was written"


def test_an_existing_artifact_is_never_replaced_overwrite_or_not(export_models, store):
    from strop.export_svc.core.errors import AlreadyExists

    req = ExportRequest(
        targets=[ExportTarget.gguf("F16", artifact_id="my-gguf")],
        base_model_path="llama-bpe",
        verify=VerifyOptions(skip=True),
    )
    (first,) = run_export(req, model_root=export_models, store=store)
    req.targets = [ExportTarget.gguf("Q8_0", artifact_id="my-gguf")]
    for overwrite in (False, True):  # before: overwrite=True replaced it in place
        req.overwrite = overwrite
        with pytest.raises(
            AlreadyExists, match="'my-gguf' already exists; published artifacts are immutable"
        ):
            run_export(req, model_root=export_models, store=store)
        assert store.get("my-gguf").sha256 == first.artifact.sha256, (
            "the refused export left the artifact alone"
        )
    store.delete("my-gguf")
    (second,) = run_export(req, model_root=export_models, store=store)
    assert [f.name for f in store.get("my-gguf").files] == ["llama-bpe-Q8_0.gguf"]
    assert second.artifact.sha256 != first.artifact.sha256


def test_an_export_from_a_corrupted_adapter_artifact_is_refused_with_data_loss(export_models, tmp_path):
    # today: the export SUCCEEDED on the corrupted adapter
    from strop.common.artifacts import ArtifactStore
    from strop.common.errors import DataLoss
    from strop.common.export_types import ExportRequest, ExportTarget
    from strop.export_svc.core.pipeline import run_export

    store = ArtifactStore(tmp_path / "arts")
    with store.create("adapter", owner="", artifact_id="bad-adapter") as p:
        for f in (export_models / "trained-nf4-lora").iterdir():
            (p.dir / f.name).write_bytes(f.read_bytes())
    weights = store.path_of("bad-adapter") / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    req = ExportRequest(targets=[ExportTarget.peft()], adapter_artifact_id="bad-adapter")
    with pytest.raises(DataLoss, match=r"adapter_model\.safetensors"):
        run_export(req, model_root=export_models, store=store)
    assert [a.artifact_id for a in store.list()] == ["bad-adapter"], "nothing was exported"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_values_is_refused_by_every_target(export_models, tmp_path, value):
    # before: CreateExport(PEFT_ADAPTER) from an adapter of 32,768 non-finite values SUCCEEDED (verification skipped)
    from safetensors.torch import load_file, save_file

    from strop.common.artifacts import ArtifactStore
    from strop.common.export_types import ExportRequest, ExportTarget
    from strop.export_svc.core.pipeline import run_export

    store = ArtifactStore(tmp_path / "arts")
    with store.create("adapter", owner="", artifact_id="nan-adapter") as p:
        for f in (export_models / "trained-nf4-lora").iterdir():
            (p.dir / f.name).write_bytes(f.read_bytes())
        tensors = load_file(p.dir / "adapter_model.safetensors")
        name = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[name][0, 0] = value
        save_file(tensors, p.dir / "adapter_model.safetensors")
    for target in (ExportTarget.peft(), ExportTarget.gguf("F16")):
        req = ExportRequest(
            targets=[target], adapter_artifact_id="nan-adapter", verify=VerifyOptions(skip=True)
        )
        with pytest.raises(errors.InvalidArgument, match=rf"{name} holds 1 non-finite values of \d+"):
            run_export(req, model_root=export_models, store=store)
    assert [a.artifact_id for a in store.list()] == ["nan-adapter"], "nothing was exported"


def test_watch_export_refuses_a_negative_after_seq_like_the_trainer(export_models, tmp_path):
    from strop.common.artifacts import ArtifactStore
    from strop.export_svc.core.jobs import ExportManager

    manager = ExportManager(tmp_path / "state", export_models, ArtifactStore(tmp_path / "arts"))
    try:
        with pytest.raises(errors.InvalidArgument, match="after_seq must be >= 0, got -5"):
            manager.poll("exp-anything", -5)
    finally:
        manager.shutdown()
