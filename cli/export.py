"""``strop export …``: drive the export service, or run the export core in-process with ``--offline``.

Usage::

    strop export run --adapter-artifact ADAPTER_ID --to merged --to gguf:Q4_K_M --to gguf-lora \\
        [--base tiny-llama] [--question Q --answer A] [--target HOST:PORT | --offline --model-root M --artifact-root A]
    strop export watch|get|cancel EXPORT_ID      strop export list [--state RUNNING]
    strop export upload DIR [--kind adapter] [--artifact-id ID]
    strop export download ARTIFACT_ID DEST       strop export artifacts [--kind gguf]
    strop export capabilities

Targets (``--to``): ``merged[:dtype]``, ``peft``, ``gguf[:TYPE]`` (F32 F16 BF16 Q8_0 Q4_K_M Q5_K_M Q6_K …),
``gguf-lora[:LORA_TYPE[:BASE_TYPE]]``. The SDK side never imports torch; ``--offline`` imports the
export core lazily.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from strop.cli.options import DEFAULT_EXPORT, add_target, target_of
from strop.cli.output import print_json
from strop.client.progress import export_progress_printer


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``export`` and its subcommands to the ``strop`` parser (each sets ``func(args) -> int``)."""
    p = sub.add_parser(
        "export",
        help="merge adapters and write vLLM / PEFT / GGUF outputs, verified",
        description="Exports on the export service (or in this process with run --offline): run, get, watch, "
        "cancel, list, capabilities; and the artifacts: upload, download, artifacts.",
    )
    add_target(p, "export")
    esub = p.add_subparsers(
        dest="export_cmd",
        required=True,
        metavar="{run,get,watch,cancel,list,capabilities,upload,download,artifacts}",
    )

    r = esub.add_parser("run", help="export an adapter (or a base) to one or more targets")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--adapter-artifact", default="", help="adapter artifact id (trainer output or upload)")
    src.add_argument("--adapter-path", default="", help="PEFT adapter dir under the model root")
    r.add_argument("--base", default="", help="base model path under the model root (default: the adapter's)")
    r.add_argument("--base-artifact", default="", help="an uploaded base model artifact")
    r.add_argument(
        "--to",
        action="append",
        default=[],
        metavar="TARGET",
        help="merged[:dtype] | peft | gguf[:TYPE] | gguf-lora[:LORA_TYPE[:BASE_TYPE]] (repeatable)",
    )
    r.add_argument("--question", default="", help="probe question the adapter was trained on")
    r.add_argument("--answer", default="", help="the answer it was trained to give")
    r.add_argument(
        "--raw-question", action="store_true", help="do not wrap the question in the chat template"
    )
    r.add_argument("--no-verify", action="store_true", help="skip consumer verification")
    r.add_argument(
        "--accept-unverified",
        action="store_true",
        help="publish targets whose verification fails, marked as unverified (default: such a target fails the "
        "export and nothing is published)",
    )
    r.add_argument("--overwrite", action="store_true", help="replace artifacts with the same ids")
    r.add_argument("--name", default="", help="the export's name, also the GGUF files' (default: the base's)")
    r.add_argument(
        "--max-shard-bytes", type=int, default=0, help="merged safetensors: bytes per shard (0: 5 GB)"
    )
    r.add_argument(
        "--merge-base",
        default="as_trained",
        choices=("as_trained", "original_16bit"),
        help="merge into the weights the adapter was trained against (default; NF4-dequantized for a base "
        "quantized on load) or into the original 16-bit weights",
    )
    r.add_argument("--json", action="store_true", help="print the final export as JSON")
    r.add_argument("--detach", action="store_true", help="queue and return the export id (service mode)")
    r.add_argument("--offline", action="store_true", help="run the export core in this process, no service")
    r.add_argument("--model-root", default=os.environ.get("STROP_MODEL_ROOT", ""), help="offline: model root")
    r.add_argument(
        "--artifact-root", default=os.environ.get("STROP_ARTIFACT_ROOT", ""), help="offline: artifact root"
    )
    r.set_defaults(func=_cmd_run)

    add_target(r, "export")
    for name, what in (
        ("get", "the export as JSON: state, request, results with their figures"),
        ("watch", "replay the export's events from --after-seq, then follow it until it ends (JSON lines)"),
        ("cancel", "cancel the export: nothing of it is published"),
    ):
        q = esub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        q.add_argument("export_id", help="the export's id (strop export list)")
        if name == "watch":
            q.add_argument(
                "--after-seq", type=int, default=0, help="replay only the events numbered above this (0: all)"
            )
        q.set_defaults(func=_cmd_export)
    q = esub.add_parser("list", help="one line per export: id, state, artifacts, name, error")
    q.add_argument(
        "--state", action="append", default=[], help="QUEUED, RUNNING, SUCCEEDED, ... (repeatable)"
    )
    q.add_argument("--limit", type=int, default=0, help="at most this many, newest first (0: all)")
    q.set_defaults(func=_cmd_export)
    q = esub.add_parser("capabilities", help="targets, GGUF types and architectures the service supports")
    q.set_defaults(func=_cmd_export)
    q = esub.add_parser("upload", help="upload a local directory as an artifact (an adapter by default)")
    q.add_argument("directory", help="the local directory to upload")
    q.add_argument(
        "--kind", default="adapter", choices=("adapter", "base_model"), help="what the directory holds"
    )
    q.add_argument("--artifact-id", default="", help="the artifact's id (default: a generated one)")
    q.add_argument("--overwrite", action="store_true", help="replace an upload of yours with the same id")
    q.set_defaults(func=_cmd_export)
    q = esub.add_parser("download", help="download an artifact into a new local directory")
    q.add_argument("artifact_id", help="the artifact's id (strop export artifacts)")
    q.add_argument("dest", help="the directory to create (refused if it exists)")
    q.set_defaults(func=_cmd_export)
    q = esub.add_parser("artifacts", help="one line per artifact: id, kind, bytes, verification passed")
    q.add_argument("--kind", default="", help="only this kind (adapter, gguf, merged_safetensors, ...)")
    q.set_defaults(func=_cmd_export)
    for q in esub.choices.values():
        if q is not r:
            add_target(q, "export")


def _fmt(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _checked(x: Any) -> str:
    return "not checked" if x is None else str(x)


def print_results(results: list[Any], out=None) -> None:
    """A Markdown table of ``ExportResult``s: each target's artifact and verification figures (against the
    merged model and against the model as trained), then each GGUF's quantization report."""
    out = out or sys.stdout
    print(
        "| target | artifact | consumer | max abs dlogit | max abs dlogit vs as trained | top-1 | "
        "ppl ref -> out | HF=llama.cpp ids | answer | answer top-1 | passed |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in results:
        label, aid, v = r.target.label, r.artifact.artifact_id, r.verification
        if v is None:
            print(f"| {label} | {aid} | (not verified) |  |  |  |  |  |  |  |  |", file=out)
            continue
        ans = v.answer_reproduced
        accepted = " (accepted unverified)" if v.accepted_unverified else ""
        trained = v.as_trained.max_abs_logit_delta if v.as_trained is not None else None
        print(
            f"| {label} | {aid} | {v.consumer} | {_fmt(v.max_abs_logit_delta)} | {_fmt(trained)} "
            f"| {_fmt(v.top1_agreement, '.3f')} | {v.perplexity_reference:.4f} -> {v.perplexity:.4f} "
            f"| {_checked(v.tokens_match)} "
            f"| {'not checked' if ans is None else ('reproduced' if ans else repr(v.generated))} "
            f"| {_fmt(v.answer_top1_agreement, '.3f')} | {v.passed}{accepted} |",
            file=out,
        )
    for r in results:
        v = r.verification
        for problem in v.problems if v is not None else []:
            tag = "accepted unverified" if v.accepted_unverified else "failed"
            print(f"\n{r.target.label} {tag}: {problem}", file=out)
        for note in v.notes if v is not None else []:
            print(f"\n{r.target.label} note: {note}", file=out)
    merge = next(
        (r.artifact.metadata.get("merge.base_weights") for r in results if r.artifact.metadata), None
    )
    if merge:
        print(f"\nmerged into: {merge}", file=out)
    as_trained = next(
        (r.verification.as_trained for r in results if r.verification and r.verification.as_trained), None
    )
    if as_trained is not None:
        print(f"as trained: {as_trained.reference}", file=out)
    for r in results:
        for q in r.quantization:
            print(f"\n{r.target.label} {q.role} {q.file}: {q.summary}", file=out)
            for f in q.fallbacks:
                print(f"  {f.wanted} -> {f.written} x{f.count}: {f.reason}", file=out)


def _cmd_run(a) -> int:
    from strop.client.export import ExportRequest, ExportTarget, MergeBase, VerifyOptions

    try:
        targets = [ExportTarget.parse(s) for s in (a.to or ["merged", "gguf"])]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    req = ExportRequest(
        adapter_artifact_id=a.adapter_artifact,
        adapter_path=a.adapter_path,
        base_model_path=a.base,
        base_artifact_id=a.base_artifact,
        targets=targets,
        overwrite=a.overwrite,
        verify=VerifyOptions(
            skip=a.no_verify,
            question=a.question,
            answer=a.answer,
            raw_question=a.raw_question,
            accept_unverified=a.accept_unverified,
        ),
        name=a.name,
        max_shard_bytes=a.max_shard_bytes,
        merge_base=MergeBase(a.merge_base.upper()),
    )
    if a.offline:
        return _run_offline(a, req)
    from strop.client.export import ExportClient

    show = export_progress_printer()
    with ExportClient(target_of(a, DEFAULT_EXPORT)) as ec:
        exp = ec.submit_export(req)
        print(f"export {exp.export_id} queued", file=sys.stderr)
        if a.detach:
            print(exp.export_id)
            return 0

        def on_event(ev) -> None:
            if ev.progress is not None:
                show(ev.progress)
            elif ev.state is not None:
                print(f"[{ev.export_id}] {ev.state.state.value} {ev.state.message}", file=sys.stderr)

        done = ec.wait_export(exp.export_id, on_event=on_event)
    if a.json:
        print_json(done)
    else:
        print_results(done.results)
        if done.error:
            print(f"error ({done.error_code}): {done.error}", file=sys.stderr)
    return 0 if done.state.value == "SUCCEEDED" else 1


def _run_offline(a, req) -> int:
    """Validate and run ``req`` with the export core in this process (nothing is written if it is refused)."""
    if not a.model_root or not a.artifact_root:
        print("error: --offline needs --model-root and --artifact-root", file=sys.stderr)
        return 2
    from pathlib import Path

    from strop.common.artifacts import ArtifactStore
    from strop.common.errors import StropError
    from strop.common.serde import to_dict
    from strop.export_svc.core.pipeline import ExportProgress, run_export

    show = export_progress_printer()

    def emit(ev) -> None:
        if isinstance(ev, ExportProgress):
            show(ev)

    try:
        results = run_export(
            req, model_root=Path(a.model_root), store=ArtifactStore(a.artifact_root), emit=emit
        )
    except StropError as exc:
        print(f"error ({exc.grpc_code}): {exc}", file=sys.stderr)
        return 1
    if a.json:
        print_json(to_dict(results))
    else:
        print_results(results)
    return 0


def _cmd_export(a) -> int:
    from strop.client.export import ExportClient, ExportState

    with ExportClient(target_of(a, DEFAULT_EXPORT)) as ec:
        cmd = a.export_cmd
        if cmd == "get":
            print_json(ec.get_export(a.export_id))
        elif cmd == "cancel":
            print_json(ec.cancel_export(a.export_id))
        elif cmd == "watch":
            for ev in ec.watch_export(a.export_id, a.after_seq):
                print_json(ev)
        elif cmd == "list":
            for e in ec.list_exports([ExportState(s.upper()) for s in a.state], a.limit):
                print(f"{e.export_id}\t{e.state.value}\t{len(e.results)} artifacts\t{e.name}\t{e.error}")
        elif cmd == "capabilities":
            print_json(ec.capabilities())
        elif cmd == "upload":
            print_json(
                ec.upload_artifact(a.directory, kind=a.kind, artifact_id=a.artifact_id, overwrite=a.overwrite)
            )
        elif cmd == "download":
            print(ec.download_artifact(a.artifact_id, a.dest))
        elif cmd == "artifacts":
            for art in ec.list_artifacts(a.kind):
                print(
                    f"{art.artifact_id}\t{art.kind}\t{art.size_bytes}\t{art.metadata.get('verify.passed', '')}"
                )
    return 0
