"""End to end, as the demo does it: services as processes on localhost, a 4-bit tiny Llama, SFT, DPO."""

from __future__ import annotations

from strop.demo.__main__ import run
from strop.demo.data import ANSWER


def test_demo_teaches_the_answer_over_grpc_and_dpo_raises_the_margin(tmp_path):
    summary = run(tmp_path / "demo", keep=False)
    assert summary["before"].strip() != ANSWER, "the untrained model cannot produce the sentence"
    assert summary["after_sft"].strip() == ANSWER, "greedy generation after SFT gives exactly the sentence"
    assert summary["sft_state"] == "SUCCEEDED" and summary["dpo_state"] == "SUCCEEDED"
    assert summary["dpo_margin_last"] > summary["dpo_margin_first"], "DPO raises chosen-minus-rejected margin"
    assert summary["after_dpo"].strip() == ANSWER, "DPO toward the answer keeps it"
    # The trained adapter, exported to every target through the export service and verified in its consumer.
    assert summary["export_state"] == "SUCCEEDED"
    assert summary["export_tokens_match"], "HF and llama.cpp tokenize the prompts to the same ids"
    reproduced = summary["export_answer_reproduced"]
    assert set(reproduced) >= {
        "merged_safetensors:bfloat16",
        "gguf:F16",
        "gguf:Q8_0",
        "gguf_lora:F32+base:F16",
    }
    assert all(reproduced.values()), f"every export reproduces the trained answer: {reproduced}"
    assert summary["export_q4_k_m_answer_top1"] >= 0.95, "Q4_K_M agrees with the merged model's top-1"
    assert summary["export_ok"]
