"""One export, end to end: resolve inputs, refuse bad ones before writing, write every target, verify, publish.

``run_export`` is the core's entry point (the job manager runs it in a worker thread; the CLI's
``--offline`` mode calls it directly). Order of work:

1. validate the request (targets, types, dtypes) — ``UnknownFormat`` lists the valid values;
2. resolve and open the adapter and the base (paths confined under the model/artifact roots), check
   the adapter fits the base and the tokenizer exists, check each target can express the adapter,
   check no target artifact exists (unless ``overwrite``) — all before a byte is written;
3. build the fp32 reference and the probe (if verifying);
4. write each target into its pending artifact directory, check it the way its consumer would, verify
   it in the consumer; record the figures in the artifact's metadata;
5. publish every artifact (atomic renames). Any exception or a cancellation before this point
   discards every pending directory and scratch file: a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strop.common.artifacts import ArtifactStore, PendingArtifact
from strop.common.export_types import (
    Capabilities,
    ExportProgress,
    ExportRequestInfo,
    ExportResult,
    ExportTarget,
    ExportTargetKind,
)
from strop.common.paths import confine
from strop.common.trainer_types import Artifact
from strop.export_svc.core import verify as V
from strop.export_svc.core.archs import DTYPES
from strop.export_svc.core.errors import (
    AlreadyExists,
    ConsumerRejected,
    ExportCancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TargetRefused,
    UnknownFormat,
)
from strop.export_svc.core.gguf_out import (
    DIRECT_TYPES,
    LORA_TYPES,
    load_vocab,
    write_gguf_lora,
    write_gguf_model,
)
from strop.export_svc.core.hf_dir import (
    DEFAULT_MAX_SHARD_BYTES,
    check_vllm_model_dir,
    generation_config_for,
    write_merged_dir,
)
from strop.export_svc.core.peft_dir import check_vllm_lora_dir, refusals, write_peft_dir
from strop.export_svc.core.quantize import QUANTIZER_FTYPES, quantize_gguf
from strop.export_svc.core.sources import (
    Adapter,
    BaseModel,
    check_compatible,
    check_same_family,
    open_adapter,
    read_json,
    tokenizer_source,
)


class TargetKind(enum.StrEnum):
    """What an export writes. The values are artifact kinds; the API's ``ExportTargetKind`` has the same names."""

    MERGED_SAFETENSORS = "merged_safetensors"  # vLLM/transformers-ready merged directory
    PEFT_ADAPTER = "peft_adapter"  # adapter dir for vLLM --enable-lora
    GGUF = "gguf"  # merged GGUF model (F32/F16/BF16/Q8_0 or a llama.cpp quantizer type)
    GGUF_LORA = "gguf_lora"  # GGUF LoRA adapter + the GGUF of its (unmerged) base


GGUF_TYPES = sorted({*DIRECT_TYPES, *QUANTIZER_FTYPES})
ADAPTER_KINDS = ("adapter", "peft_adapter", "checkpoint")


@dataclass
class TargetSpec:
    """One output. Empty strings take the defaults noted."""

    kind: TargetKind
    gguf_type: str = (
        ""  # GGUF: one of GGUF_TYPES (default F16); GGUF_LORA: adapter tensors F32/F16/BF16 (F32)
    )
    dtype: str = ""  # MERGED_SAFETENSORS: bfloat16/float16/float32 (default: the base's dtype)
    artifact_id: str = ""  # default: generated
    base_gguf_type: str = ""  # GGUF_LORA: type of the base GGUF written beside the adapter (default F16)

    @property
    def label(self) -> str:
        if self.kind is TargetKind.GGUF:
            return f"gguf:{self.gguf_type}"
        if self.kind is TargetKind.GGUF_LORA:
            return f"gguf_lora:{self.gguf_type}+base:{self.base_gguf_type}"
        if self.kind is TargetKind.MERGED_SAFETENSORS:
            return f"merged_safetensors:{self.dtype}"
        return "peft_adapter"

    @classmethod
    def from_api(cls, t: ExportTarget) -> TargetSpec:
        # a kind without a core counterpart (UNSPECIFIED) passes as a string; normalize_targets refuses it
        kind = TargetKind.__members__.get(t.kind.name) or f"target kind {t.kind.value}"
        return cls(kind, t.gguf_type, t.dtype, t.artifact_id, t.base_gguf_type)  # type: ignore[arg-type]

    def to_api(self) -> ExportTarget:
        kind = ExportTargetKind[TargetKind(self.kind).name]
        return ExportTarget(kind, self.gguf_type, self.dtype, self.artifact_id, self.base_gguf_type)


@dataclass
class ExportRequest:
    """What to export: an adapter (artifact id or path) onto a base (path, artifact id, or recorded)."""

    targets: list[TargetSpec]
    adapter_artifact_id: str = ""
    adapter_path: str = ""  # under the model root or the artifact root
    base_path: str = ""  # under the model root; empty: the adapter's recorded base
    base_artifact_id: str = ""
    overwrite: bool = False
    verify: V.VerifySpec = field(default_factory=V.VerifySpec)
    name: str = ""
    max_shard_bytes: int = 0  # 0: 5 GB

    def to_api(self) -> ExportRequestInfo:
        return ExportRequestInfo(
            adapter_artifact_id=self.adapter_artifact_id,
            adapter_path=self.adapter_path,
            base_model_path=self.base_path,
            base_artifact_id=self.base_artifact_id,
            targets=[t.to_api() for t in self.targets],
            overwrite=self.overwrite,
            verify=self.verify.to_api(),
            name=self.name,
            max_shard_bytes=self.max_shard_bytes,
        )


@dataclass
class TargetResult:
    target: TargetSpec
    artifact: Artifact
    verification: V.Verification | None = None

    def to_api(self) -> ExportResult:
        v = self.verification.to_api() if self.verification is not None else None
        return ExportResult(self.target.to_api(), self.artifact, v)


class CancelToken:
    """Set by a client's cancel; checked before every tensor and between phases."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise ExportCancelled("the export was cancelled; nothing was published")


Emit = Callable[[Any], None]


def normalize_targets(targets: list[TargetSpec]) -> list[TargetSpec]:
    """Fill defaults and validate kinds, types and dtypes.

    Raises:
        InvalidArgument: no targets, or two targets asking for the same artifact id.
        UnknownFormat: an unknown kind, GGUF type or dtype (the message lists the valid ones).
    """
    if not targets:
        raise InvalidArgument("an export needs at least one target")
    out = []
    for t in targets:
        try:
            kind = TargetKind(t.kind)
        except ValueError:
            raise UnknownFormat(
                f"unknown target {t.kind!r}; valid: {[k.value for k in TargetKind]}"
            ) from None
        t = TargetSpec(kind, t.gguf_type.upper(), t.dtype, t.artifact_id, t.base_gguf_type.upper())
        if kind is TargetKind.GGUF:
            t.gguf_type = t.gguf_type or "F16"
            if t.gguf_type not in GGUF_TYPES:
                raise UnknownFormat(f"unknown GGUF type {t.gguf_type!r}; valid: {', '.join(GGUF_TYPES)}")
        if kind is TargetKind.GGUF_LORA:
            t.gguf_type = t.gguf_type or "F32"
            t.base_gguf_type = t.base_gguf_type or "F16"
            if t.gguf_type not in LORA_TYPES:
                raise UnknownFormat(
                    f"unknown GGUF LoRA tensor type {t.gguf_type!r}; valid: {sorted(LORA_TYPES)}"
                )
            if t.base_gguf_type not in GGUF_TYPES:
                raise UnknownFormat(
                    f"unknown base GGUF type {t.base_gguf_type!r}; valid: {', '.join(GGUF_TYPES)}"
                )
        if kind is TargetKind.MERGED_SAFETENSORS and t.dtype and t.dtype not in DTYPES:
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
        raise InvalidArgument(f"{what} {user_path!r} is outside the allowed roots {[str(r) for r in roots]}")
    last: Exception | None = None
    for root in roots:
        try:
            return confine(root, user_path, what=what)
        except NotFound as exc:
            last = exc
    assert last is not None
    raise last


@dataclass
class Resolved:
    base: BaseModel
    adapter: Adapter | None
    tokenizer_dir: Path
    base_ref: str  # the base's path relative to the model root (or "artifact:<id>")
    adapter_ref: str
    source_metadata: dict[str, str]
    vocab: Any = None  # GGUF tokenizer metadata, loaded once when a GGUF target needs it


def resolve(req: ExportRequest, model_root: Path, store: ArtifactStore) -> Resolved:
    """Open the adapter and the base and check they belong together (nothing is written)."""
    model_root = Path(model_root).resolve()
    adapter, meta, adapter_ref = None, {}, ""
    if req.adapter_artifact_id and req.adapter_path:
        raise InvalidArgument("give either adapter_artifact_id or adapter_path, not both")
    if req.adapter_artifact_id:
        info = store.get(req.adapter_artifact_id)
        if info.kind not in ADAPTER_KINDS:
            raise InvalidArgument(f"artifact {info.artifact_id!r} is a {info.kind!r}, not an adapter")
        adapter_ref = f"artifact:{info.artifact_id}"
        adapter = open_adapter(store.path_of(info.artifact_id), adapter_ref)
        meta = dict(info.metadata)
    elif req.adapter_path:
        path = _confine_any(req.adapter_path, [model_root, store.root], "adapter path")
        adapter_ref = req.adapter_path
        adapter = open_adapter(path, req.adapter_path)

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

    if req.base_artifact_id and req.base_path:
        raise InvalidArgument("give either base_path or base_artifact_id, not both")
    if req.base_artifact_id:
        store.get(req.base_artifact_id)
        base_path, base_ref = store.path_of(req.base_artifact_id), f"artifact:{req.base_artifact_id}"
    elif req.base_path:
        base_path, base_ref = confine(model_root, req.base_path, what="base path"), req.base_path
    elif recorded is not None:
        base_path, base_ref = recorded, recorded_label
    elif adapter is not None:
        said = meta.get("base_model") or adapter.recorded_base or "(nothing)"
        raise FailedPrecondition(
            f"cannot resolve the base of adapter {adapter_ref!r}: it names {said!r}, which is not under the "
            f"model root {str(model_root)!r}; pass base_path"
        )
    else:
        raise InvalidArgument("an export needs a base (base_path or base_artifact_id) or an adapter")
    if base_path.is_relative_to(model_root):
        base_ref = str(base_path.relative_to(model_root))
    base = BaseModel(base_path, base_ref)
    if adapter is not None:
        if recorded is not None and recorded != base_path and (recorded / "config.json").is_file():
            check_same_family(
                read_json(recorded / "config.json", f"{recorded_label}/config.json"), recorded_label, base
            )
        check_compatible(adapter, base)
    tok_dir = tokenizer_source(adapter, base)
    source_meta = {
        k: v for k, v in meta.items() if k in ("job_id", "step", "base_quantization", "session_id")
    }
    return Resolved(base, adapter, tok_dir, base_ref, adapter_ref, source_meta)


def preflight(
    targets: list[TargetSpec], r: Resolved, store: ArtifactStore, overwrite: bool
) -> list[TargetSpec]:
    """Per-target refusals and artifact-id clashes, before anything is written."""
    out = []
    for t in targets:
        if t.kind is TargetKind.MERGED_SAFETENSORS and not t.dtype:
            t.dtype = r.base.dtype
        if t.kind in (TargetKind.PEFT_ADAPTER, TargetKind.GGUF_LORA) and r.adapter is None:
            raise InvalidArgument(
                f"target {t.kind.value} needs an adapter (adapter_artifact_id or adapter_path)"
            )
        if t.kind is TargetKind.PEFT_ADAPTER:
            assert r.adapter is not None
            why = refusals(r.adapter)
            if why:
                raise TargetRefused(
                    f"adapter {r.adapter.label!r} cannot be a vLLM LoRA adapter: " + "; ".join(why)
                )
        if t.kind is TargetKind.GGUF_LORA:
            assert r.adapter is not None
            if (
                r.adapter.use_dora
                or r.adapter.replacements
                or any(m.kind == "embedding" for m in r.adapter.modules.values())
            ):
                raise TargetRefused(
                    f"adapter {r.adapter.label!r} uses DoRA, embedding LoRA or whole-module weights, "
                    "which a GGUF LoRA cannot carry; export a merged GGUF"
                )
        if not t.artifact_id:
            t.artifact_id = f"{t.kind.value.replace('_', '-')}-{(t.gguf_type or t.dtype or 'lora').lower()}-{uuid.uuid4().hex[:10]}"
        if store.exists(t.artifact_id) and not overwrite:
            raise AlreadyExists(f"artifact {t.artifact_id!r} already exists (ask to overwrite to replace it)")
        out.append(t)
    return out


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(label).name).strip("-.") or "model"


class _Exporter:
    """The state of one running export (scratch files, the shared F32 GGUF, the probe)."""

    def __init__(
        self,
        req: ExportRequest,
        r: Resolved,
        store: ArtifactStore,
        emit: Emit,
        cancel: CancelToken,
        export_id: str,
    ):
        self.req, self.r, self.store, self.emit, self.cancel, self.export_id = (
            req,
            r,
            store,
            emit,
            cancel,
            export_id,
        )
        self.scratch = store.root / ".tmp" / f"scratch-{uuid.uuid4().hex[:10]}"
        self.scratch.mkdir(parents=True)
        self.model_name = _safe_name(req.name or r.base_ref)
        self._exact: dict[str, Path] = {}
        self.probe: V.Probe | None = None

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def vocab(self):
        if self.r.vocab is None:
            self.r.vocab = load_vocab(self.r.tokenizer_dir, self.r.base.config)
        return self.r.vocab

    def hooks(self, label: str, phase: str, total: int):
        def before(_name: str) -> None:
            self.cancel.check()

        def after(name: str, i: int, written: int, btotal: int) -> None:
            self.emit(ExportProgress(label, phase, name, i + 1, total, written, btotal))

        return before, after

    def write_gguf(self, path: Path, gguf_type: str, label: str, *, merged: bool = True) -> None:
        adapter = self.r.adapter if merged else None
        if gguf_type in DIRECT_TYPES:
            before, after = self.hooks(label, "write", len(self.r.base.tensors))
            write_gguf_model(
                path,
                self.r.base,
                adapter,
                self.vocab(),
                gguf_type=gguf_type,
                name=self.model_name,
                before_tensor=before,
                after_tensor=after,
            )
            return
        src = self.exact_gguf(label, merged=merged)
        self.cancel.check()
        self.emit(ExportProgress(label, "quantize", gguf_type))
        quantize_gguf(
            src,
            path,
            gguf_type,
            on_tensor=lambda i, n, name: self.emit(ExportProgress(label, "quantize", name, i, n)),
        )
        self.cancel.check()

    def exact_gguf(self, label: str, *, merged: bool) -> Path:
        """A GGUF holding the weights exactly, for llama.cpp's quantizer (written once per export).

        F32 whenever something was computed (a merge, a 4-bit dequantization); when the weights are
        the base's 16-bit tensors untouched, its own dtype (BF16/F16) is exact and half the bytes.
        """
        key = "merged" if merged and self.r.adapter is not None else "base"
        if key not in self._exact:
            base = self.r.base
            dtypes = {t.dtype for t in base.tensors.values()}
            lossless = (
                {torch.bfloat16: "BF16", torch.float16: "F16"}.get(next(iter(dtypes)))
                if len(dtypes) == 1
                else None
            )
            gguf_type = lossless if key == "base" and lossless and base.quantization == "none" else "F32"
            p = self.scratch / f"{key}-{gguf_type}.gguf"
            self.write_gguf(p, gguf_type, label, merged=key == "merged")
            self._exact[key] = p
        return self._exact[key]

    def build_probe(self) -> None:
        spec = self.req.verify
        gen = generation_config_for(self.r.base).get("eos_token_id") or []
        self.probe = V.build_probe(spec, self.r.tokenizer_dir, gen if isinstance(gen, list) else [gen])
        before, _ = self.hooks("reference", "reference", len(self.r.base.tensors))
        model = V.reference_model(self.r.base, self.r.adapter, before_tensor=before)
        self.emit(ExportProgress("reference", "reference", "logits"))
        V.fill_reference(self.probe, model)
        del model
        gc.collect()

    def write_target(self, t: TargetSpec, pending: PendingArtifact) -> V.Verification | None:
        r, d = self.r, pending.dir
        label = t.label
        verify = self.probe is not None
        if t.kind is TargetKind.MERGED_SAFETENSORS:
            before, after = self.hooks(label, "write", len(r.base.tensors))
            write_merged_dir(
                d,
                r.base,
                r.adapter,
                r.tokenizer_dir,
                dtype=t.dtype,
                max_shard_bytes=self.req.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                before_tensor=before,
                after_tensor=after,
            )
            problems = check_vllm_model_dir(d)
            if problems:
                raise ConsumerRejected(f"the merged directory fails vLLM's checks: {problems[:3]}")
            pending.metadata["vllm.checked"] = (
                "config, index, tensor names and shapes, tokenizer, chat template"
            )
            if not verify:
                return None
            self.emit(ExportProgress(label, "verify", "transformers"))
            return V.verify_hf_dir(self.probe, d)
        if t.kind is TargetKind.PEFT_ADAPTER:
            assert r.adapter is not None
            self.emit(ExportProgress(label, "write", "adapter_model.safetensors", 0, 1))
            write_peft_dir(d, r.adapter, r.base_ref, r.tokenizer_dir)
            problems, need = check_vllm_lora_dir(d, r.base)
            if problems:
                raise ConsumerRejected(f"the PEFT directory fails vLLM's checks: {problems[:3]}")
            pending.metadata["vllm.max_lora_rank"] = str(need)
            pending.metadata["vllm.serve"] = (
                f"vllm serve <base> --enable-lora --max-lora-rank {need} --lora-modules name=<dir>"
            )
            self.emit(ExportProgress(label, "write", "adapter_model.safetensors", 1, 1))
            if not verify:
                return None
            self.emit(ExportProgress(label, "verify", "transformers+peft"))
            return V.verify_peft_dir(self.probe, r.base.path, d)
        if t.kind is TargetKind.GGUF:
            path = d / f"{self.model_name}-{t.gguf_type}.gguf"
            self.write_gguf(path, t.gguf_type, label)
            pending.metadata["gguf.file"] = path.name
            if not verify:
                return None
            self.emit(ExportProgress(label, "verify", "llama.cpp"))
            return V.verify_gguf(self.probe, path, lossy=t.gguf_type in QUANTIZER_FTYPES)
        assert r.adapter is not None
        base_path = d / f"{self.model_name}-base-{t.base_gguf_type}.gguf"
        self.write_gguf(base_path, t.base_gguf_type, label, merged=False)
        lora_path = d / f"{self.model_name}-lora-{t.gguf_type}.gguf"
        before, after = self.hooks(label, "write", len(r.adapter.modules))
        write_gguf_lora(
            lora_path,
            r.base,
            r.adapter,
            lora_type=t.gguf_type,
            name=f"{self.model_name}-lora",
            before_tensor=before,
            after_tensor=after,
        )
        pending.metadata["gguf.base_file"] = base_path.name
        pending.metadata["gguf.lora_file"] = lora_path.name
        if not verify:
            return None
        self.emit(ExportProgress(label, "verify", "llama.cpp+lora"))
        return V.verify_gguf(
            self.probe, base_path, lora_path=lora_path, lossy=t.base_gguf_type in QUANTIZER_FTYPES
        )


def validate(req: ExportRequest, model_root: Path, store: ArtifactStore) -> tuple[ExportRequest, Resolved]:
    """Every check that needs no weights: returns the request with defaults and artifact ids filled in.

    Cheap (config, headers, tokenizer files), so the service runs it before accepting an export and
    bad input gets its status code at once.
    """
    targets = normalize_targets(req.targets)
    r = resolve(req, Path(model_root), store)
    targets = preflight(targets, r, store, req.overwrite)
    if any(t.kind in (TargetKind.GGUF, TargetKind.GGUF_LORA) for t in targets):
        r.vocab = load_vocab(r.tokenizer_dir, r.base.config)  # an unsupported tokenizer fails here
    return dataclasses.replace(req, targets=targets), r


def run_export(
    req: ExportRequest,
    *,
    model_root: Path,
    store: ArtifactStore,
    emit: Emit | None = None,
    cancel: CancelToken | None = None,
    export_id: str = "",
) -> list[TargetResult]:
    """Run one export to completion; returns the published artifacts with their verification figures.

    Raises:
        StropError subclasses for bad input (before anything is written), ExportCancelled on cancel.
        Either way no artifact of this export is left behind.
    """
    emit = emit or (lambda _e: None)
    cancel = cancel or CancelToken()
    emit(ExportProgress("", "resolve"))
    req, r = validate(req, Path(model_root), store)
    targets = req.targets
    ex = _Exporter(req, r, store, emit, cancel, export_id)
    try:
        cancel.check()
        if req.verify.enabled:
            ex.build_probe()
        results: list[TargetResult] = []
        with contextlib.ExitStack() as stack:
            pendings = []
            for t in targets:
                cancel.check()
                meta = {
                    "target": t.kind.value,
                    "export_id": export_id,
                    "base_model": r.base_ref,
                    "base_quantization": r.base.quantization,
                    "adapter": r.adapter_ref,
                    "merge.base_weights": (
                        f"{r.base.quantization} dequantized to float32"
                        if r.base.quantization != "none"
                        else f"{r.base.dtype} as stored"
                    ),
                    **({"gguf_type": t.gguf_type} if t.gguf_type else {}),
                    **({"dtype": t.dtype} if t.dtype else {}),
                    **({"base_gguf_type": t.base_gguf_type} if t.base_gguf_type else {}),
                    **{f"source.{k}": v for k, v in r.source_metadata.items()},
                }
                pending = stack.enter_context(
                    store.create(
                        t.kind.value, artifact_id=t.artifact_id, metadata=meta, overwrite=req.overwrite
                    )
                )
                v = ex.write_target(t, pending)
                if v is not None:
                    pending.metadata.update(v.to_metadata())
                pendings.append((t, pending, v))
                cancel.check()
            emit(ExportProgress("", "publish", "", 0, len(pendings)))
            cancel.check()
        # leaving the ExitStack published every pending artifact
        for t, pending, v in pendings:
            results.append(TargetResult(t, store.get(pending.artifact_id), v))
        return results
    finally:
        ex.close()


def capabilities() -> Capabilities:
    """What this build of the exporter writes."""
    from strop.export_svc.core.archs import ARCHS

    return Capabilities(
        targets=[k.value for k in TargetKind],
        gguf_types=GGUF_TYPES,
        gguf_lora_types=sorted(LORA_TYPES),
        dtypes=sorted(DTYPES),
        architectures=sorted(ARCHS),
        base_quantizations=["none", "bnb-nf4", "bnb-fp4"],
    )
