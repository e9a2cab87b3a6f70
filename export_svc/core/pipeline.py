"""One export, end to end: validate, write every target, verify, publish; nothing is left on failure.

``write_export`` takes a :class:`~strop.export_svc.core.resolve.ValidatedExport` (the job manager's
worker threads run it on what ``ExportManager.create`` validated); ``run_export`` validates and writes
in one call (the CLI's ``--offline`` mode, the benchmark, tests). Order of work:

1. ``resolve.validate``: every check that needs no weights, before a byte is written;
2. build the probe and its two fp32 references (if verifying): the merged model, and the model as
   trained (the base as the trainer loaded it + the adapter unmerged, by PEFT);
3. write each target into its pending artifact directory, check it the way its consumer would, verify
   it in the consumer against both references; read each GGUF back for its quantization report;
   record the figures and the report in the artifact's metadata;
4. publish every artifact (atomic renames). Any exception or a cancellation before this point
   discards every pending directory and scratch file: a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import gc
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strop.common.adapter_base import NF4_STATS_FILE, write_base_record
from strop.common.archs import MODEL_TYPES
from strop.common.artifacts import ArtifactStore, PendingArtifact
from strop.common.export_types import (
    Capabilities,
    ExportProgress,
    ExportRequest,
    ExportResult,
    ExportTarget,
    ExportTargetKind,
    MergeBase,
    QuantizationReport,
    Verification,
)
from strop.export_svc.core import verify as V
from strop.export_svc.core.base_source import DTYPES
from strop.export_svc.core.errors import ConsumerRejected, ExportCancelled, VerificationFailed
from strop.export_svc.core.gguf_out import write_gguf_lora, write_gguf_model
from strop.export_svc.core.gguf_types import EXACT_TYPE_OF, GGUF_TYPES, LORA_TYPES
from strop.export_svc.core.hf_dir import (
    DEFAULT_MAX_SHARD_BYTES,
    check_vllm_model_dir,
    generation_config_for,
    write_merged_dir,
)
from strop.export_svc.core.peft_dir import check_vllm_lora_dir, write_peft_dir
from strop.export_svc.core.quantize import LoggedFallback, quantization_report, quantize_gguf, report_metadata
from strop.export_svc.core.resolve import Inputs, ValidatedExport, validate

K = ExportTargetKind


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


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(label).name).strip("-.") or "model"


class _Exporter:
    """The state of one running export (scratch files, the exact GGUFs the quantizer reads, the probe)."""

    def __init__(self, job: ValidatedExport, store: ArtifactStore, emit: Emit, cancel: CancelToken):
        self.req: ExportRequest = job.request
        self.inputs: Inputs = job.inputs
        self.store, self.emit, self.cancel = store, emit, cancel
        self.scratch = store.root / ".tmp" / f"scratch-{uuid.uuid4().hex[:10]}"
        self.scratch.mkdir(parents=True)
        self.model_name = _safe_name(self.req.name or self.inputs.base_ref)
        self._exact: dict[str, Path] = {}
        self._logged: dict[Path, dict[str, LoggedFallback]] = {}  # llama.cpp's fallback lines, per file
        self.probe: V.Probe | None = None

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def hooks(self, label: str, phase: str, total: int):
        def before(_name: str) -> None:
            self.cancel.check()

        def after(name: str, i: int, written: int, btotal: int) -> None:
            self.emit(ExportProgress(label, phase, name, i + 1, total, written, btotal))

        return before, after

    def write_base_files(self, d: Path) -> None:
        """A PEFT dir records the base its adapter was trained on (``strop_base.json``) and carries the trainer's NF4
        scale statistics, so a later export of the directory alone reproduces the model as trained."""
        inputs = self.inputs
        record = dict(inputs.base_record)
        if not record:
            return  # an adapter strop did not train: nothing is known of its training beyond the base it names
        if not inputs.base_ref.startswith("artifact:"):
            record["base_model"] = inputs.base_ref  # the name the PEFT dir's adapter_config.json gives too
        if inputs.on_load is not None and inputs.on_load.stats_file:
            shutil.copy2(inputs.on_load.stats_file, d / NF4_STATS_FILE)
        write_base_record(d, record)

    def as_trained_serving(self) -> str:
        """What to serve for the model as trained: this export's as-trained merged dir, or how to get one."""
        merged = [
            t.artifact_id
            for t in self.req.targets
            if t.kind is K.MERGED_SAFETENSORS and self.inputs.merge_base is MergeBase.AS_TRAINED
        ]
        if merged:
            return f"the as-trained merged model instead: artifact {merged[0]} of this export"
        return (
            "the as-trained merged model instead: export this adapter to merged (strop export run --to merged; "
            "merge_base AS_TRAINED is the default)"
        )

    def write_gguf(self, path: Path, gguf_type: str, label: str, *, merged: bool = True) -> None:
        inputs = self.inputs
        if GGUF_TYPES[gguf_type].direct:
            assert inputs.vocab is not None, "validate loads the vocab for every GGUF target"
            before, after = self.hooks(label, "write", len(inputs.base.tensors))
            write_gguf_model(
                path,
                inputs.base,
                inputs.adapter if merged else None,
                inputs.vocab,
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
            fallbacks=self._logged.setdefault(path, {}),
        )
        self.cancel.check()

    def report(self, path: Path, gguf_type: str, role: str, pending: PendingArtifact) -> QuantizationReport:
        """The quantization report of a written GGUF, also recorded in the artifact's metadata."""
        r = quantization_report(path, gguf_type, role=role, logged=self._logged.get(path))
        pending.metadata.update(report_metadata(r))
        return r

    def exact_gguf(self, label: str, *, merged: bool) -> Path:
        """A GGUF holding the weights exactly, for llama.cpp's quantizer (written once per export).

        F32 whenever something was computed (a merge, a 4-bit dequantization); when the weights are
        the base's 16-bit tensors untouched, its own dtype (BF16/F16) is exact and half the bytes.
        """
        key = "merged" if merged and self.inputs.adapter is not None else "base"
        if key not in self._exact:
            base = self.inputs.base
            dtypes = {t.dtype for t in base.tensors.values()}
            lossless = EXACT_TYPE_OF.get(next(iter(dtypes))) if len(dtypes) == 1 else None
            # nothing dequantized
            untouched = base.quantization == "none" and base.on_load is None and base.expert_nf4 is None
            gguf_type = lossless if key == "base" and lossless and untouched else "F32"
            p = self.scratch / f"{key}-{gguf_type}.gguf"
            self.write_gguf(p, gguf_type, label, merged=key == "merged")
            self._exact[key] = p
        return self._exact[key]

    def build_probe(self) -> None:
        inputs = self.inputs
        gen = generation_config_for(inputs.base).get("eos_token_id") or []
        self.probe = V.build_probe(
            self.req.verify,
            inputs.tokenizer_dir,
            gen if isinstance(gen, list) else [gen],
            sliding_window=V.sliding_window_of(inputs.base.config),
        )
        before, _ = self.hooks("reference", "reference", len(inputs.base.tensors))
        model = V.reference_model(inputs.base, inputs.adapter, before_tensor=before)
        self.emit(ExportProgress("reference", "reference", "logits"))
        V.fill_reference(self.probe, model)
        del model
        gc.collect()
        before, _ = self.hooks("as_trained", "reference", len(inputs.base.tensors))
        model = V.as_trained_model(inputs.as_trained, inputs.adapter, before_tensor=before)
        self.emit(ExportProgress("as_trained", "reference", "logits"))
        V.fill_as_trained(self.probe, model, V.as_trained_label(inputs.as_trained, inputs.adapter))
        del model
        gc.collect()

    def write_target(
        self, t: ExportTarget, pending: PendingArtifact
    ) -> tuple[Verification | None, list[QuantizationReport]]:
        inputs, d = self.inputs, pending.dir
        label = t.label
        probe = self.probe
        if t.kind is K.MERGED_SAFETENSORS:
            before, after = self.hooks(label, "write", len(inputs.base.tensors))
            write_merged_dir(
                d,
                inputs.base,
                inputs.adapter,
                inputs.tokenizer_dir,
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
            if probe is None:
                return None, []
            self.emit(ExportProgress(label, "verify", "transformers"))
            return V.verify_hf_dir(probe, d), []
        if t.kind is K.PEFT_ADAPTER:
            assert inputs.adapter is not None
            self.emit(ExportProgress(label, "write", "adapter_model.safetensors", 0, 1))
            write_peft_dir(d, inputs.adapter, inputs.base, inputs.tokenizer_dir)
            problems, need = check_vllm_lora_dir(d, inputs.base)
            if problems:
                raise ConsumerRejected(f"the PEFT directory fails vLLM's checks: {problems[:3]}")
            pending.metadata["vllm.max_lora_rank"] = str(need)
            pending.metadata["vllm.serve"] = (
                f"vllm serve <base> --enable-lora --max-lora-rank {need} --lora-modules name=<dir>"
            )
            self.write_base_files(d)
            if inputs.on_load is not None:
                pending.metadata["peft.base_loading"] = (
                    f"the adapter was trained on its base quantized on load, {inputs.on_load.describe()}: "
                    "load the base with that BitsAndBytesConfig to serve the model as trained"
                )
                pending.metadata["peft.serve_as_trained"] = self.as_trained_serving()
            self.emit(ExportProgress(label, "write", "adapter_model.safetensors", 1, 1))
            if probe is None:
                if inputs.on_load is not None:
                    pending.metadata["peft.on_16bit_base"] = (
                        "serving this adapter on the 16-bit base as stored (vLLM --enable-lora) is another model "
                        "than the one trained on its NF4 quantization (not measured: verification was skipped)"
                    )
                return None, []
            self.emit(ExportProgress(label, "verify", "transformers+peft"))
            v = V.verify_peft_dir(probe, inputs.base.path, d, trained_base=inputs.as_trained)
            if v.on_16bit_base is not None:
                c = v.on_16bit_base
                answer = (
                    f", teacher-forced top-1 on the trained answer {c.answer_top1_agreement:.3f}"
                    if c.answer_top1_agreement is not None
                    else ""
                )
                said = (
                    "serving this adapter on the 16-bit base as stored (vLLM --enable-lora, PeftModel on the "
                    f"{inputs.base.dtype} checkpoint) is another model than the one trained (on its NF4 "
                    f"quantization): max |dlogit| {c.max_abs_logit_delta:.4g} (largest |logit| "
                    f"{c.max_abs_logit:.4g}), top-1 {c.top1_agreement:.3f}{answer} against the model as trained; "
                    f"serve {self.as_trained_serving()}"
                )
                v.notes.append(said)
                pending.metadata["peft.on_16bit_base"] = said
            return v, []
        if t.kind is K.GGUF:
            path = d / f"{self.model_name}-{t.gguf_type}.gguf"
            self.write_gguf(path, t.gguf_type, label)
            pending.metadata["gguf.file"] = path.name
            reports = [self.report(path, t.gguf_type, "model", pending)]
            if probe is None:
                return None, reports
            self.emit(ExportProgress(label, "verify", "llama.cpp"))
            return V.verify_gguf(probe, path, lossy=GGUF_TYPES[t.gguf_type].lossy), reports
        assert t.kind is K.GGUF_LORA and inputs.adapter is not None
        base_path = d / f"{self.model_name}-base-{t.base_gguf_type}.gguf"
        self.write_gguf(base_path, t.base_gguf_type, label, merged=False)
        lora_path = d / f"{self.model_name}-lora-{t.gguf_type}.gguf"
        before, after = self.hooks(label, "write", len(inputs.adapter.modules))
        write_gguf_lora(
            lora_path,
            inputs.base,
            inputs.adapter,
            lora_type=t.gguf_type,
            name=f"{self.model_name}-lora",
            before_tensor=before,
            after_tensor=after,
        )
        pending.metadata["gguf.base_file"] = base_path.name
        pending.metadata["gguf.lora_file"] = lora_path.name
        reports = [
            self.report(base_path, t.base_gguf_type, "base", pending),
            self.report(lora_path, t.gguf_type, "lora", pending),
        ]
        if probe is None:
            return None, reports
        self.emit(ExportProgress(label, "verify", "llama.cpp+lora"))
        v = V.verify_gguf(probe, base_path, lora_path=lora_path, lossy=GGUF_TYPES[t.base_gguf_type].lossy)
        return v, reports


def merge_base_weights(inputs: Inputs) -> str:
    """What the merge (and a GGUF LoRA's base GGUF) reads as the base's weights, in words."""
    base, trained = inputs.base, inputs.as_trained
    if base.on_load is not None:
        return (
            f"{base.dtype} weights quantized as the trainer did on load, {base.on_load.describe()}"
            + (" (settings assumed: the artifact predates their recording)" if base.on_load.assumed else "")
            + ", dequantized to float32: the model as trained"
        )
    if base.quantization != "none":
        return f"{base.quantization} dequantized to float32: the model as trained"
    if trained is not base:
        return (
            f"{base.dtype} as stored (ORIGINAL_16BIT), not the NF4 weights the adapter was trained against; "
            "verify.as_trained.* shows the difference"
        )
    if inputs.adapter is not None and not inputs.source_metadata.get("base_quantization"):
        return f"{base.dtype} as stored (the adapter records no quantization on load)"
    return f"{base.dtype} as stored: the model as trained"


def _nf4_codes_metadata(inputs: Inputs) -> dict[str, str]:
    """For a base quantized on load: whether the NF4 codes re-created here are the trainer's (one weight's
    codes and absmax against the sha256 the trainer recorded)."""
    experts = getattr(inputs.as_trained, "expert_nf4", None)
    out = {"merge.nf4_expert_codes": _expert_codes(experts, inputs.as_trained)} if experts is not None else {}
    spec = inputs.on_load
    if spec is None:
        return out
    verdict = inputs.as_trained.check_codes()
    words = {
        "bit-identical": f"bit-identical to the trainer's ({spec.digest_tensor}: sha256 of codes and absmax)",
        "differ": (
            f"DIFFER from the trainer's for {spec.digest_tensor}: this bitsandbytes quantizes the base otherwise "
            "(another version or device); the model as trained is approximated, not reproduced"
        ),
        "not recorded": "not checked (the adapter's artifact records no digest of the trainer's codes)",
    }
    return {"merge.nf4_codes": words[verdict], **out}


def _expert_codes(experts, base) -> str:
    """The NF4 experts' verdict in words (``moe.ExpertNf4.check_codes``)."""
    return {
        "bit-identical": f"bit-identical to the trainer's ({experts.digest_stack}: sha256 of codes and absmax)",
        "differ": (
            f"DIFFER from the trainer's for {experts.digest_stack}: this bitsandbytes quantizes the experts "
            "otherwise (another version or device); the model as trained is approximated, not reproduced"
        ),
        "not recorded": "not checked (the adapter records no digest of the trainer's expert codes)",
    }[experts.check_codes(base)]


def _artifact_metadata(
    t: ExportTarget, inputs: Inputs, export_id: str, tenant: str, extra: dict[str, str]
) -> dict[str, str]:
    base = inputs.base
    return {
        **extra,
        "target": t.kind.artifact_kind,
        "tenant": tenant,
        "export_id": export_id,
        "base_model": inputs.base_ref,
        "base_quantization": base.quantization,
        "adapter": inputs.adapter_ref,
        "merge.base": inputs.merge_base.value,
        "merge.base_weights": merge_base_weights(inputs),
        **({"gguf_type": t.gguf_type} if t.gguf_type else {}),
        **({"dtype": t.dtype} if t.dtype else {}),
        **({"base_gguf_type": t.base_gguf_type} if t.base_gguf_type else {}),
        **{f"source.{k}": v for k, v in inputs.source_metadata.items()},
    }


def verification_failure(failed: list[tuple[ExportTarget, Verification]], total: int) -> str:
    """The error of an export whose targets failed verification: each target with its consumer and problems."""
    each = "; ".join(f"{t.label} ({v.consumer}): {' / '.join(v.problems)}" for t, v in failed)
    return (
        f"verification failed for {len(failed)} of {total} target(s), so nothing was published: {each}. "
        "Set verify.accept_unverified (CLI --accept-unverified) to publish them anyway, marked as unverified"
    )


def write_export(
    job: ValidatedExport,
    *,
    store: ArtifactStore,
    emit: Emit | None = None,
    cancel: CancelToken | None = None,
    export_id: str = "",
) -> list[ExportResult]:
    """Write, verify and publish every target of a validated export; returns the published artifacts.

    A target whose verification fails (``passed`` False, its ``problems`` saying why) fails the export with
    ``VerificationFailed`` naming every such target, unless ``req.verify.accept_unverified``: then it is
    published and its verification says ``accepted_unverified``.

    Raises:
        VerificationFailed when an output does not reproduce the model, ConsumerRejected when a consumer
        refuses an output, ExportCancelled on cancel, OSError, ...
        Whatever the failure, no artifact of this export is left behind.
    """
    emit = emit or (lambda _e: None)
    cancel = cancel or CancelToken()
    req, inputs = job.request, job.inputs
    if inputs.base_ref.startswith("artifact:"):  # an uploaded base: its digests are checked before any read
        store.verify(inputs.base_ref.removeprefix("artifact:"))
    ex = _Exporter(job, store, emit, cancel)
    try:
        cancel.check()
        codes = _nf4_codes_metadata(inputs)
        if not req.verify.skip:
            ex.build_probe()
        with contextlib.ExitStack() as stack:
            pendings: list[
                tuple[ExportTarget, PendingArtifact, Verification | None, list[QuantizationReport]]
            ] = []
            for t in req.targets:
                cancel.check()
                pending = stack.enter_context(
                    store.create(
                        t.kind.artifact_kind,
                        owner=job.tenant,
                        artifact_id=t.artifact_id,
                        metadata=_artifact_metadata(t, inputs, export_id, job.tenant, codes),
                    )
                )
                v, reports = ex.write_target(t, pending)
                if v is not None and codes.get("merge.nf4_codes", "").startswith("DIFFER"):
                    v.notes.append("the re-created NF4 codes " + codes["merge.nf4_codes"])
                if v is not None:
                    v.accepted_unverified = not v.passed and req.verify.accept_unverified
                    pending.metadata.update(V.verification_metadata(v))
                pendings.append((t, pending, v, reports))
                cancel.check()
            failed = [(t, v) for t, _, v, _ in pendings if v is not None and not v.passed]
            if failed and not req.verify.accept_unverified:
                raise VerificationFailed(verification_failure(failed, len(pendings)))
            emit(ExportProgress("", "publish", "", 0, len(pendings)))
            cancel.check()
        # leaving the ExitStack published every pending artifact
        return [ExportResult(t, store.get(p.key), v, reports) for t, p, v, reports in pendings]
    finally:
        ex.close()


def run_export(
    req: ExportRequest,
    *,
    model_root: Path,
    store: ArtifactStore,
    emit: Emit | None = None,
    cancel: CancelToken | None = None,
    export_id: str = "",
) -> list[ExportResult]:
    """Validate ``req`` and run it to completion in this thread (``validate`` + ``write_export``).

    Raises:
        StropError subclasses for bad input (before anything is written), ExportCancelled on cancel.
        Either way no artifact of this export is left behind.
    """
    (emit or (lambda _e: None))(ExportProgress("", "resolve"))
    job = validate(req, Path(model_root), store)
    return write_export(job, store=store, emit=emit, cancel=cancel, export_id=export_id)


def capabilities() -> Capabilities:
    """What this build of the exporter writes."""
    return Capabilities(
        targets=[k.artifact_kind for k in K.known()],
        gguf_types=sorted(GGUF_TYPES),
        gguf_lora_types=sorted(LORA_TYPES),
        dtypes=sorted(DTYPES),
        architectures=sorted(MODEL_TYPES),
        base_quantizations=["none", "bnb-nf4", "bnb-fp4"],
    )
