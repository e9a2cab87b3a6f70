"""Honest quantization reports: what a GGUF file holds, read back from it, and why any tensor fell back.

K-quants pack rows in 256-wide super-blocks. A row width that 256 does not divide cannot be a K-quant,
and llama.cpp's quantizer silently uses its fallback type instead (llama-quant.cpp: Q4_K → Q5_0,
Q5_K → Q5_1, Q6_K → Q8_0; F16 if that type's block does not divide it either). With hidden 320 and
intermediate 640 every weight of a "Q4_K_M" file falls back (issue 12 item 3 saw 181 of 211 with
hidden 576); with hidden 256 and intermediate 512 none does. Which tensors Q4_K_M asks Q6_K of, in a
2-layer model: ``output`` and, in the second half of the layers, ``attn_v`` and ``ffn_down``
(llama.cpp's ``use_more_bits``), so a 320-wide model gets Q6_K → Q8_0 for those three and Q4_K → Q5_0
for the other 13 (token_embd and 6 projections per layer).
"""

from __future__ import annotations

from collections import Counter

import gguf
import pytest

from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
from strop.export_svc.core.pipeline import run_export


@pytest.fixture(scope="module")
def narrow_model(export_models):
    """A llama with hidden 320 / intermediate 640 (neither a multiple of 256), beside the other bases."""
    from strop.fixtures import make_tiny_model
    from strop.fixtures.tiny_models import TinyShape

    name = "llama-bpe-h320"
    if not (export_models / name).exists():
        make_tiny_model(export_models / name, seed=3, shape=TinyShape(hidden_size=320, intermediate_size=640))
    return name


def _types_in(path) -> Counter:
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)


def test_q4_k_m_report_names_every_fallback_with_its_count_when_rows_are_not_multiples_of_256(
    export_models, store, narrow_model
):
    r = run_export(
        ExportRequest(
            base_model_path=narrow_model,
            targets=[ExportTarget.gguf("Q4_K_M")],
            verify=VerifyOptions(skip=True),
        ),
        model_root=export_models,
        store=store,
    )[0]
    (rep,) = r.quantization
    path = store.path_of(r.artifact.artifact_id) / r.artifact.metadata["gguf.file"]
    written = _types_in(path)
    assert written == {"Q5_0": 13, "Q8_0": 3, "F32": 5}, "2 x 7 projections + token_embd + output; 5 norms"
    assert {c.type: c.count for c in rep.tensor_types} == dict(written), "the report is the file's own types"
    fb = {(f.wanted, f.written): f for f in rep.fallbacks}
    assert {k: f.count for k, f in fb.items()} == {("Q4_K", "Q5_0"): 13, ("Q6_K", "Q8_0"): 3}
    assert "output.weight" in fb["Q6_K", "Q8_0"].tensors, "llama.cpp falls output back without logging it"
    assert {"blk.1.attn_v.weight", "blk.1.ffn_down.weight"} <= set(fb["Q6_K", "Q8_0"].tensors)
    assert "not a multiple of 256" in fb["Q4_K", "Q5_0"].reason and "320" in fb["Q4_K", "Q5_0"].reason
    assert "16 of 16 weight tensors fell back" in rep.summary
    meta = r.artifact.metadata
    assert meta["quant.tensor_types"] == "Q5_0=13, F32=5, Q8_0=3"
    assert (
        meta["quant.fallbacks"].startswith("Q4_K->Q5_0=13 (") and "Q6_K->Q8_0=3 (" in meta["quant.fallbacks"]
    )
    assert meta["quant.summary"] == rep.summary


def test_q4_k_m_report_shows_no_fallback_when_rows_are_multiples_of_256(export_models, store):
    r = run_export(
        ExportRequest(
            base_model_path="llama-bpe",
            targets=[ExportTarget.gguf("Q4_K_M")],
            verify=VerifyOptions(skip=True),
        ),
        model_root=export_models,
        store=store,
    )[0]
    (rep,) = r.quantization
    assert rep.fallbacks == [] and r.artifact.metadata["quant.fallbacks"] == "none"
    assert {c.type: c.count for c in rep.tensor_types} == {"Q4_K": 13, "Q6_K": 3, "F32": 5}
    assert rep.summary.endswith("no fallbacks")


def test_direct_types_and_gguf_lora_files_are_reported_too(export_models, store, narrow_model):
    results = run_export(
        ExportRequest(
            base_model_path="llama-bpe",
            adapter_path="llama-bpe-lora",
            targets=[ExportTarget.gguf("Q8_0"), ExportTarget.gguf_lora("F32", "Q4_K_M")],
            verify=VerifyOptions(skip=True),
        ),
        model_root=export_models,
        store=store,
    )
    by = {r.target.label: r for r in results}
    (q8,) = by["gguf:Q8_0"].quantization
    assert {c.type: c.count for c in q8.tensor_types} == {"Q8_0": 16, "F32": 5} and q8.fallbacks == []
    base, lora = by["gguf_lora:F32+base:Q4_K_M"].quantization
    assert (base.role, lora.role) == ("base", "lora")
    assert {c.type: c.count for c in lora.tensor_types} == {"F32": 28}, "A and B of 14 projections"
    assert by["gguf_lora:F32+base:Q4_K_M"].artifact.metadata["quant.base.fallbacks"] == "none"


def test_the_final_result_event_carries_the_report(export_models, tmp_path, narrow_model):
    from strop.client.export import ExportClient
    from strop.export_svc.server import ExportConfig, start

    srv = start(ExportConfig(export_models, tmp_path / "artifacts", tmp_path / "state"))
    try:
        with ExportClient(f"127.0.0.1:{srv.port}") as c:
            exp = c.create_export(
                [ExportTarget.gguf("Q4_K_M")], base_model_path=narrow_model, verify=VerifyOptions(skip=True)
            )
            events = list(c.watch_export(exp.export_id))
            done = c.get_export(exp.export_id)
    finally:
        srv.stop(grace=5.0)
    (result_event,) = [e for e in events if e.result is not None]
    (rep,) = result_event.result.quantization
    assert {(f.wanted, f.written): f.count for f in rep.fallbacks} == {
        ("Q4_K", "Q5_0"): 13,
        ("Q6_K", "Q8_0"): 3,
    }
    assert done.results[0].quantization == result_event.result.quantization, "the stored export keeps it"
