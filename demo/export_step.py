"""The demo's export step: the trained adapter to every target, each verified in its consumer.

Called by ``python -m strop.demo`` after SFT + DPO with a running export service and the trainer's
adapter artifact. Everything goes through the ExportClient SDK (no torch in this process).
"""

from __future__ import annotations

import sys
from typing import Any

from strop.client.export import ExportClient, ExportState, ExportTarget, VerifyOptions

DEMO_TARGETS = (
    ExportTarget.merged(),
    ExportTarget.peft(),
    ExportTarget.gguf("F16"),
    ExportTarget.gguf("Q8_0"),
    ExportTarget.gguf("Q4_K_M"),
    ExportTarget.gguf_lora("F32", "F16"),
)


def run_export_demo(
    export_target: str,
    adapter_artifact_id: str,
    *,
    question: str,
    answer: str,
    base_model_path: str = "",
    targets: tuple[ExportTarget, ...] = DEMO_TARGETS,
    name: str = "demo",
    out=None,
) -> dict[str, Any]:
    """Export ``adapter_artifact_id`` to every target through the service at ``export_target``.

    Prints progress and a table of figures, and returns them: per target the artifact id, max
    |Δlogit| and top-1 agreement against the merged fp32 model and max |Δlogit| against the model as
    trained (the base as the trainer loaded it + the adapter unmerged), perplexity (reference →
    output), HF vs llama.cpp token ids ("not checked" for merged/PEFT outputs), the greedy answer and
    whether it reproduces ``answer``, and teacher-forced top-1 agreement on the answer's tokens; then
    what the merge went into, and each GGUF's quantization report (tensor types read back from the
    file, fallbacks with their reasons). ``export_ok`` is the acceptance check: token ids equal;
    the merged dir, F16, Q8_0 and GGUF base + LoRA reproduce the answer; Q4_K_M agrees ≥ 95%.
    """
    out = out or sys.stdout
    with ExportClient(export_target) as ec:
        exp = ec.create_export(
            list(targets),
            adapter_artifact_id=adapter_artifact_id,
            base_model_path=base_model_path,
            verify=VerifyOptions(question=question, answer=answer),
            name=name,
        )
        print(f"export {exp.export_id}: {', '.join(t.label for t in exp.request.targets)}", file=out)

        def on_event(ev) -> None:
            p = ev.progress
            if (
                p is not None
                and p.phase in ("quantize", "verify", "publish")
                and p.items_done in (0, p.items_total)
            ):
                print(f"  [{p.target or 'export'}] {p.phase} {p.item}", file=out)
            elif ev.state is not None:
                print(f"  {ev.state.state.value} {ev.state.message}", file=out)

        done = ec.wait_export(exp.export_id, on_event=on_event)
    summary: dict[str, Any] = {"export_id": done.export_id, "export_state": done.state.value}
    if done.state is not ExportState.SUCCEEDED:
        summary.update(export_error=f"{done.error_code}: {done.error}", export_ok=False)
        print(f"export failed: {done.error_code}: {done.error}", file=out)
        return summary
    figures: dict[str, dict[str, Any]] = {}
    print(
        "\n| target | consumer | max abs dlogit | vs as trained | top-1 | ppl ref -> out | HF=llama.cpp ids "
        "| answer | answer top-1 |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for r in done.results:
        v = r.verification
        label = r.target.label
        figures[label] = {
            "artifact": r.artifact.artifact_id,
            "consumer": v.consumer,
            "max_abs_logit_delta": v.max_abs_logit_delta,
            "top1_agreement": v.top1_agreement,
            "perplexity_reference": v.perplexity_reference,
            "perplexity": v.perplexity,
            "perplexity_delta": v.perplexity_delta,
            "as_trained_max_abs_logit_delta": v.as_trained.max_abs_logit_delta if v.as_trained else None,
            "tokens_match": v.tokens_match,
            "generated": v.generated,
            "answer_reproduced": v.answer_reproduced,
            "answer_top1_agreement": v.answer_top1_agreement,
            "passed": v.passed,
            "quantization": [q.summary for q in r.quantization],
        }
        toks = "not checked" if v.tokens_match is None else str(v.tokens_match)
        ans = "reproduced" if v.answer_reproduced else repr(v.generated)
        trained = "-" if v.as_trained is None else f"{v.as_trained.max_abs_logit_delta:.4g}"
        top1 = "-" if v.answer_top1_agreement is None else f"{v.answer_top1_agreement:.3f}"
        print(
            f"| {label} | {v.consumer} | {v.max_abs_logit_delta:.4g} | {trained} | {v.top1_agreement:.3f} | "
            f"{v.perplexity_reference:.3f} -> {v.perplexity:.3f} | {toks} | {ans} | {top1} |",
            file=out,
        )
    first = done.results[0]
    print(f"\nmerged into: {first.artifact.metadata.get('merge.base_weights', '?')}", file=out)
    if first.verification is not None and first.verification.as_trained is not None:
        print(f"as trained: {first.verification.as_trained.reference}", file=out)
    print("\nquantization reports (read back from each GGUF file):", file=out)
    for r in done.results:
        for q in r.quantization:
            print(f"  {r.target.label} [{q.role}] {q.summary}", file=out)
            for f in q.fallbacks:
                print(f"    {f.wanted} -> {f.written} x{f.count}: {f.reason}", file=out)
    reproduce = ("merged_safetensors:bfloat16", "gguf:F16", "gguf:Q8_0", "gguf_lora:F32+base:F16")
    summary.update(
        export_figures=figures,
        export_tokens_match=all(f["tokens_match"] for f in figures.values() if f["tokens_match"] is not None),
        export_answer_reproduced={k: figures[k]["answer_reproduced"] for k in reproduce if k in figures},
        export_q4_k_m_answer_top1=figures.get("gguf:Q4_K_M", {}).get("answer_top1_agreement"),
        export_merged_vs_as_trained=figures.get("merged_safetensors:bfloat16", {}).get(
            "as_trained_max_abs_logit_delta"
        ),
        export_q4_k_m_report=" / ".join(figures.get("gguf:Q4_K_M", {}).get("quantization", [])),
    )
    summary["export_ok"] = (
        summary["export_tokens_match"]
        and all(summary["export_answer_reproduced"].values())
        and (summary["export_q4_k_m_answer_top1"] or 0.0) >= 0.95
    )
    print(f"\nexport acceptance: {'OK' if summary['export_ok'] else 'FAILED'}", file=out)
    return summary
