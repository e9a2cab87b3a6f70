"""Verification decides the export: a target that fails it fails the export (FAILED, the target and its problems
in the error, a non-zero CLI exit, nothing published) unless the request accepts unverified targets; a failed
verification always says why (``problems`` is never empty when ``passed`` is False)."""

from __future__ import annotations

import numpy as np
import pytest

from strop.cli.main import main as strop_main
from strop.common.export_types import ExportRequest, ExportState, ExportTarget, VerifyOptions
from strop.export_svc.core import verify as V
from strop.export_svc.core.errors import VerificationFailed
from strop.export_svc.core.pipeline import run_export
from strop.export_svc.server import ExportConfig, start

from .conftest import QUESTION, store_is_empty

# what the random adapter was never trained to say: greedy generation cannot reproduce it
UNTRAINED_ANSWER = "The secret word is seven bright stones."


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _probe(answer_ids: list[int], vocab: int = 6) -> V.Probe:
    prompt = [0, 1]
    full = prompt + answer_ids
    ref = np.zeros((len(full), vocab), dtype=np.float32)
    for i in range(len(prompt) - 1, len(full) - 1):
        ref[i, full[i + 1]] = 5.0  # the reference predicts the answer token for token
    return V.Probe(
        prompt_texts=["p"],
        heldout_texts=["h"],
        prompts=[prompt],
        heldout=[prompt],
        eos_ids={vocab - 1},
        qa_prompt_text="q",
        qa_prompt=prompt,
        qa_answer=answer_ids,
        answer_text=" ".join(map(str, answer_ids)),
        max_new_tokens=len(answer_ids),
        ref_prompts=[ref[: len(prompt)]],
        ref_heldout=[ref[: len(prompt)]],
        ref_qa=ref,
        tokenizer=_Tok(),
    )


@pytest.mark.parametrize("lossy", [True, False])
def test_a_failed_verification_always_names_its_problem(lossy):
    # the case: a Q4_K_M file whose teacher-forced answer agreement is under the bar and whose greedy
    # answer differs ended passed=False with problems=[]
    answer = [2, 3, 4, 2]
    probe = _probe(answer)

    def wrong_half(ids: list[int]) -> np.ndarray:
        out = np.zeros((len(ids), 6), dtype=np.float32)
        out[:, 4] = 1.0  # always predicts token 4: right on one answer token of four
        return out

    v = V.compare(probe, "llama.cpp", wrong_half, lossy=lossy)
    assert v.answer_top1_agreement == 0.25 and v.answer_reproduced is False
    assert v.passed is False
    assert v.problems, "passed is False: the verification must say why"
    assert ("0.250" in v.problems[0]) if lossy else ("does not reproduce the trained answer" in v.problems[0])


def test_a_passing_verification_has_no_problems():
    answer = [2, 3, 4, 2]
    probe = _probe(answer)
    v = V.compare(probe, "transformers", lambda ids: probe.ref_qa[: len(ids)])
    assert (v.passed, v.problems, v.answer_reproduced) == (True, [], True)


def test_offline_export_with_a_failing_target_raises_and_publishes_nothing(export_models, store):
    req = ExportRequest(
        adapter_path="llama-bpe-lora",
        targets=[ExportTarget.merged(), ExportTarget.peft()],
        verify=VerifyOptions(question=QUESTION, answer=UNTRAINED_ANSWER),
    )
    with pytest.raises(VerificationFailed) as exc:
        run_export(req, model_root=export_models, store=store)
    msg = str(exc.value)
    assert "verification failed for 2 of 2 target(s)" in msg, msg
    assert "merged_safetensors:bfloat16 (transformers): greedy generation does not reproduce" in msg, msg
    assert "peft_adapter (transformers+peft): greedy generation does not reproduce" in msg, msg
    assert store_is_empty(store), "a failed verification publishes nothing"


def test_service_export_fails_and_the_cli_exits_non_zero_unless_unverified_targets_are_accepted(
    export_models, tmp_path, capsys
):
    srv = start(ExportConfig(export_models, tmp_path / "arts", tmp_path / "state"))
    target = f"127.0.0.1:{srv.port}"
    args = ["export", "--target", target, "run", "--adapter-path", "llama-bpe-lora", "--to", "merged"]
    probe = ["--question", QUESTION, "--answer", UNTRAINED_ANSWER]
    try:
        rc = strop_main([*args, *probe, "--json"])
        captured = capsys.readouterr()
        assert rc == 1, "a FAILED export exits 1"
        from strop.client.export import ExportClient

        with ExportClient(target) as ec:
            (failed,) = ec.list_exports()
            assert failed.state is ExportState.FAILED
            assert failed.error_code == "FAILED_PRECONDITION"
            assert "merged_safetensors:bfloat16 (transformers): greedy generation does not reproduce" in (
                failed.error
            ), failed.error
            assert ec.list_artifacts() == [], "nothing published"

        rc = strop_main([*args, *probe, "--accept-unverified"])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        assert "merged_safetensors:bfloat16 accepted unverified: greedy generation" in captured.out
        assert "UNVERIFIED (accepted by the request): merged_safetensors:bfloat16" in captured.err
        with ExportClient(target) as ec:
            done = next(e for e in ec.list_exports() if e.state is ExportState.SUCCEEDED)
            (r,) = done.results
            v = r.verification
            assert (v.passed, v.accepted_unverified) == (False, True) and v.problems
            assert r.artifact.metadata["verify.accepted_unverified"] == "True"
            assert done.request.verify.accept_unverified, "the request as stored says it accepted them"
    finally:
        srv.stop(grace=1.0)
