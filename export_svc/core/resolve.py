"""An export request checked and resolved before a byte is written: ``validate``, run once per export.

1. the targets: kinds, GGUF types and dtypes known (``UnknownFormat`` lists the valid values), the
   defaults filled in (:data:`strop.common.export_types.DEFAULT_GGUF_TYPE` and its siblings);
2. the inputs: the adapter and the base opened (paths confined under the model/artifact roots), the
   adapter checked against the base and against the base it was trained on, the tokenizer found;
3. per target: that it can express the adapter (DoRA for vLLM, embedding LoRA for GGUF, ...) and the base
   (a Gemma setting llama.cpp hard-codes otherwise refuses GGUF), its
   artifact id (generated when not given) not taken in the caller's id space (artifacts are immutable), the
   dtype of a merged
   directory (default: the base's);
4. for GGUF targets, the tokenizer read into GGUF metadata (an unsupported tokenizer fails here).

Cheap (config, headers, tokenizer files; no weights), so the service validates before it accepts an
export and bad input gets its status code at once. The result, a :class:`ValidatedExport`, is what
the writer (``pipeline.write_export``) takes: it re-checks nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import uuid
from dataclasses import dataclass
from pathlib import Path

from strop.common import auth
from strop.common.adapter_base import NF4_STATS_FILE, base_record, read_base_record
from strop.common.artifacts import ArtifactStore, check_artifact_id, key_of
from strop.common.export_types import (
    DEFAULT_GGUF_LORA_BASE_TYPE,
    DEFAULT_GGUF_LORA_TYPE,
    DEFAULT_GGUF_TYPE,
    DEFAULT_MERGE_BASE,
    ExportRequest,
    ExportTarget,
    ExportTargetKind,
    MergeBase,
)
from strop.common.gguf_metadata import GgufVocab
from strop.common.paths import confine, confine_files
from strop.export_svc.core.adapter_source import (
    Adapter,
    check_compatible,
    check_same_family,
    open_adapter,
    tokenizer_source,
)
from strop.export_svc.core.base_source import DTYPES, BaseModel, read_json
from strop.export_svc.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TargetRefused,
    UnknownFormat,
)
from strop.export_svc.core.gguf_arch import check_gguf_model
from strop.export_svc.core.gguf_out import check_gguf_lora
from strop.export_svc.core.gguf_tokenizer import load_vocab
from strop.export_svc.core.gguf_types import GGUF_TYPES, LORA_TYPES
from strop.export_svc.core.moe import ExpertNf4
from strop.export_svc.core.nf4_on_load import Nf4OnLoad
from strop.export_svc.core.peft_dir import refusals

K = ExportTargetKind
ADAPTER_KINDS = ("adapter", "peft_adapter", "checkpoint")  # artifact kinds an export takes as its adapter
_SOURCE_KEYS = ("job_id", "step", "base_quantization", "session_id")  # carried from the adapter's artifact


def normalize_targets(targets: list[ExportTarget]) -> list[ExportTarget]:
    """New targets with the defaults filled in, after checking kinds, types and dtypes.

    Raises:
        InvalidArgument: no targets, or two targets asking for the same artifact id.
        UnknownFormat: an unknown kind, GGUF type or dtype (the message lists the valid ones).
    """
    if not targets:
        raise InvalidArgument("an export needs at least one target")
    gguf_types = sorted(GGUF_TYPES)
    out = []
    for t in targets:
        if t.kind not in K.known():
            raise UnknownFormat(f"unknown target kind {str(t.kind)!r}; valid: {[k.value for k in K.known()]}")
        t = dataclasses.replace(t, gguf_type=t.gguf_type.upper(), base_gguf_type=t.base_gguf_type.upper())
        if t.kind is K.GGUF:
            t.gguf_type = t.gguf_type or DEFAULT_GGUF_TYPE
            if t.gguf_type not in GGUF_TYPES:
                raise UnknownFormat(f"unknown GGUF type {t.gguf_type!r}; valid: {', '.join(gguf_types)}")
        if t.kind is K.GGUF_LORA:
            t.gguf_type = t.gguf_type or DEFAULT_GGUF_LORA_TYPE
            t.base_gguf_type = t.base_gguf_type or DEFAULT_GGUF_LORA_BASE_TYPE
            if t.gguf_type not in LORA_TYPES:
                raise UnknownFormat(
                    f"unknown GGUF LoRA tensor type {t.gguf_type!r}; valid: {sorted(LORA_TYPES)}"
                )
            if t.base_gguf_type not in GGUF_TYPES:
                raise UnknownFormat(
                    f"unknown base GGUF type {t.base_gguf_type!r}; valid: {', '.join(gguf_types)}"
                )
        if t.kind is K.MERGED_SAFETENSORS and t.dtype and t.dtype not in DTYPES:
            raise UnknownFormat(f"unknown dtype {t.dtype!r}; valid: {sorted(DTYPES)}")
        out.append(t)
    ids = [t.artifact_id for t in out if t.artifact_id]
    if len(ids) != len(set(ids)):
        raise InvalidArgument(f"two targets ask for the same artifact id: {ids}")
    return out


def _confine_any(user_path: str, roots: list[Path], what: str) -> Path:
    """``user_path`` under one of ``roots`` (absolute: must lie under one; relative: first that has it)."""
    p = Path(user_path)
    if p.is_absolute():
        for root in roots:
            with contextlib.suppress(InvalidArgument):
                return confine(root, user_path, what=what)
        raise InvalidArgument(
            f"{what} {user_path[:200]!r} is outside the allowed roots (the model root or the artifact root)"
        )
    last: Exception | None = None
    for root in roots:
        try:
            return confine(root, user_path, what=what)
        except NotFound as exc:
            last = exc
    assert last is not None
    raise last


@dataclass
class Inputs:
    """What an export reads, opened and checked: the base, the adapter, the tokenizer.

    ``base`` reads the weights the merge goes into (``merge_base``); ``trained_base`` the weights the
    adapter was trained against (the same object unless the base was quantized on load: then a
    ``quantized_on_load`` view, and ``base`` is it too unless ORIGINAL_16BIT was asked for).
    Headers and configs only (every read of a tensor opens its file anew), so holding one while an
    export waits in the queue costs memory, not file handles.
    """

    base: BaseModel
    adapter: Adapter | None
    tokenizer_dir: Path
    base_ref: str  # the base's path relative to the model root (or "artifact:<id>")
    adapter_ref: str
    source_metadata: dict[str, str]  # from the adapter's artifact: job_id, step, ...
    vocab: GgufVocab | None = None  # GGUF tokenizer metadata, loaded by ``validate`` when a target needs it
    trained_base: BaseModel | None = None  # None: ``base``
    merge_base: MergeBase = DEFAULT_MERGE_BASE
    on_load: Nf4OnLoad | None = None  # how the trainer quantized the base on load (from the artifact)
    # the base the adapter was trained on, as its artifact and its directory record it (``strop_base.json``;
    # ``strop.common.adapter_base``): what an export's PEFT dir records in turn
    base_record: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def as_trained(self) -> BaseModel:
        return self.trained_base or self.base


def resolve(req: ExportRequest, model_root: Path, store: ArtifactStore) -> Inputs:
    """Open the adapter and the base and check they belong together (nothing is written).

    Raises:
        FailedPrecondition: ORIGINAL_16BIT asked of a base that holds only 4-bit weights.
    """
    model_root = Path(model_root).resolve()
    adapter, meta, adapter_ref = None, {}, ""
    if req.adapter_artifact_id and req.adapter_path:
        raise InvalidArgument("give either adapter_artifact_id or adapter_path, not both")
    if req.adapter_artifact_id:
        key = store.resolve(req.adapter_artifact_id)  # NOT_FOUND for another tenant's, as for a missing one
        info = store.verify(key)  # an adapter is small: every file's sha256 is checked now
        if info.kind not in ADAPTER_KINDS:
            raise InvalidArgument(f"artifact {info.artifact_id!r} is a {info.kind!r}, not an adapter")
        adapter_ref = f"artifact:{key}"
        adapter = open_adapter(store.path_of(key), adapter_ref)
        meta = dict(info.metadata)
    elif req.adapter_path:
        path = _confine_any(req.adapter_path, [model_root, store.root], "adapter path")
        root = next(r for r in (model_root, store.root.resolve()) if path == r or r in path.parents)
        confine_files(root, path, what=f"adapter {req.adapter_path!r}")
        adapter_ref = req.adapter_path
        adapter = open_adapter(path, req.adapter_path)

    if adapter is not None:
        check_finite(adapter)
        # the directory's own record of its base (every adapter strop writes carries one): what an adapter given
        # by path has instead of artifact metadata; an artifact's metadata, written with it, goes first
        meta = {**read_base_record(adapter.path), **meta}

    recorded: Path | None = None  # the base the adapter says it was trained on, when it resolves here
    recorded_label = ""
    if adapter is not None:
        for cand in (meta.get("base_model", ""), adapter.recorded_base):
            if not cand:
                continue
            with contextlib.suppress(InvalidArgument, NotFound):
                recorded = confine(model_root, cand, what="recorded base")
                recorded_label = str(recorded.relative_to(model_root))
                break

    if req.base_artifact_id and req.base_model_path:
        raise InvalidArgument("give either base_model_path or base_artifact_id, not both")
    if req.base_artifact_id:
        base_key = store.resolve(req.base_artifact_id)
        base_path, base_ref = store.path_of(base_key), f"artifact:{base_key}"
    elif req.base_model_path:
        base_path = confine(model_root, req.base_model_path, what="base path")
        confine_files(model_root, base_path, what=f"base {req.base_model_path!r}")
        base_ref = req.base_model_path
    elif recorded is not None:
        base_path, base_ref = recorded, recorded_label
    elif adapter is not None:
        said = meta.get("base_model") or adapter.recorded_base or "(nothing)"
        raise FailedPrecondition(
            f"cannot resolve the base of adapter {adapter_ref!r}: it names {said!r}, which is not under the "
            "model root; pass base_model_path"
        )
    else:
        raise InvalidArgument("an export needs a base (base_model_path or base_artifact_id) or an adapter")
    if base_path.is_relative_to(model_root):
        base_ref = str(base_path.relative_to(model_root))
    base = BaseModel(base_path, base_ref)
    if adapter is not None:
        if recorded is not None and recorded != base_path and (recorded / "config.json").is_file():
            check_same_family(
                read_json(recorded / "config.json", f"{recorded_label}/config.json"), recorded_label, base
            )
        check_compatible(adapter, base)
    merge_base = req.merge_base if req.merge_base is not MergeBase.UNSPECIFIED else DEFAULT_MERGE_BASE
    if merge_base is MergeBase.ORIGINAL_16BIT and base.quantization != "none":
        raise FailedPrecondition(
            f"merge_base ORIGINAL_16BIT: base {base_ref!r} is a {base.quantization} checkpoint and holds no "
            "16-bit weights; merge AS_TRAINED (its dequantized weights) or give the 16-bit base"
        )
    on_load = Nf4OnLoad.from_metadata(meta) if adapter is not None else None
    if on_load is not None and (adapter.path / NF4_STATS_FILE).is_file():
        on_load = dataclasses.replace(on_load, stats_file=str(adapter.path / NF4_STATS_FILE))
    trained = base.quantized_on_load(on_load) if on_load is not None and base.quantization == "none" else base
    experts = ExpertNf4.from_metadata(meta, base.config, _stats(adapter)) if adapter is not None else None
    if experts is not None:  # the trainer held the expert stacks in NF4: the model as trained reads them so
        trained = copy.copy(trained)
        trained.expert_nf4 = experts
    return Inputs(
        trained if merge_base is MergeBase.AS_TRAINED else base,
        adapter,
        tokenizer_source(adapter, base),
        base_ref,
        adapter_ref,
        {k: v for k, v in meta.items() if k in _SOURCE_KEYS},
        trained_base=trained,
        merge_base=merge_base,
        on_load=on_load if trained.on_load is not None else None,
        base_record=base_record(meta),
    )


def _stats(adapter: Adapter) -> str:
    """The trainer's recorded NF4 scale statistics in the adapter's directory, or ""."""
    path = adapter.path / NF4_STATS_FILE
    return str(path) if path.is_file() else ""


def check_finite(adapter: Adapter) -> None:
    """An adapter holding inf or NaN is refused before anything is written: every target would carry it (a PEFT
    copy as much as a merge), and its outputs would only fail their verification, if it ran.

    Raises:
        InvalidArgument: naming the first tensor with non-finite values and how many it holds.
    """
    import torch

    for name in adapter.file.names():
        t = adapter.file.read(name)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise InvalidArgument(
                f"adapter {adapter.label!r}: {name} holds {bad} non-finite values of {t.numel()}; it cannot be exported"
            )


def _artifact_id(t: ExportTarget) -> str:
    detail = (t.gguf_type or t.dtype or "lora").lower()
    return f"{t.kind.artifact_kind.replace('_', '-')}-{detail}-{uuid.uuid4().hex[:10]}"


def preflight(
    targets: list[ExportTarget], inputs: Inputs, store: ArtifactStore, owner: str
) -> list[ExportTarget]:
    """Per-target refusals and artifact-id clashes, before anything is written; fills dtype and artifact id."""
    out = []
    for t in targets:
        t = dataclasses.replace(t)
        if t.kind is K.MERGED_SAFETENSORS and not t.dtype:
            t.dtype = inputs.base.dtype
        if t.kind in (K.PEFT_ADAPTER, K.GGUF_LORA) and inputs.adapter is None:
            raise InvalidArgument(
                f"target {t.kind.value} needs an adapter (adapter_artifact_id or adapter_path)"
            )
        if t.kind is K.PEFT_ADAPTER:
            assert inputs.adapter is not None
            why = refusals(inputs.adapter, inputs.base.arch.model_type)
            if why:
                raise TargetRefused(
                    f"adapter {inputs.adapter.label!r} cannot be a vLLM LoRA adapter: " + "; ".join(why)
                )
        if t.kind is K.GGUF_LORA:
            assert inputs.adapter is not None
            check_gguf_lora(inputs.adapter)
        if t.kind in (K.GGUF, K.GGUF_LORA):
            check_gguf_model(inputs.base.config, inputs.base.arch)
        t.artifact_id = t.artifact_id or _artifact_id(t)
        if store.exists(key_of(owner, check_artifact_id(t.artifact_id))):  # in the caller's own id space
            raise AlreadyExists(
                f"artifact {t.artifact_id!r} already exists; published artifacts are immutable: choose another id"
            )
        if sum(o.artifact_id == t.artifact_id for o in out):
            raise InvalidArgument(f"two targets name the same artifact id {t.artifact_id!r}")
        out.append(t)
    return out


@dataclass
class ValidatedExport:
    """An export that passed every check: the request with defaults and artifact ids filled in, and its
    opened inputs. What ``ExportManager`` queues and ``pipeline.write_export`` writes."""

    request: ExportRequest
    inputs: Inputs
    tenant: str = ""  # the caller's, stamped on the export and on every artifact it publishes


def validate(req: ExportRequest, model_root: Path, store: ArtifactStore) -> ValidatedExport:
    """Every check that needs no weights (see the module docstring); the one validation of an export.

    Raises:
        StropError subclasses naming the problem (InvalidArgument, FailedPrecondition, Unimplemented, ...).
    """
    targets = normalize_targets(req.targets)
    inputs = resolve(req, Path(model_root), store)
    targets = preflight(targets, inputs, store, auth.current().tenant)
    if any(t.kind in (K.GGUF, K.GGUF_LORA) for t in targets):
        inputs.vocab = load_vocab(inputs.tokenizer_dir, inputs.base.config)
    req = dataclasses.replace(req, targets=targets, merge_base=inputs.merge_base)
    return ValidatedExport(req, inputs, auth.current().tenant)
