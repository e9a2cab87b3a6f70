"""The facts bench's measurement stays clean (bench/recipe_facts.py): the general questions it counts as kept are
never among the neighbour questions a KL job trains towards the base's answers.

The trainer leaves out its own held-out prompts only; the base, continuing "How many legs does", can write the
bench's own "How many legs does a cat have?", and that answer would then be counted as kept after being trained on.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from recipe_facts import GENERAL, general_never_neighbours

from strop.trainer_svc.core import retention


def test_general_questions_are_filtered_from_the_neighbour_draw_and_the_draw_is_restored(monkeypatch):
    drawn = [
        "How many legs does a cat have?",  # a general question, exactly
        "What colour is coal?",  # the same question in British spelling
        "how many  legs does a spider have?",  # not a general question
        "What is  the capital of france?",  # a general question, other case and spacing
    ]
    seen = {}

    def draw(loaded, questions, per_prefix, *, seed, exclude):
        seen.update(per_prefix=per_prefix, seed=seed, exclude=exclude)
        return list(drawn)

    monkeypatch.setattr(retention, "neighbour_prompts", draw)
    assert {"How many legs does a cat have?", "What color is coal?"} <= {q for q, _ in GENERAL}
    with general_never_neighbours():
        got = retention.neighbour_prompts(None, ["q"], 4, seed=1, exclude={"x"})
    assert got == ["how many  legs does a spider have?"], "only the non-general question is kept, in order"
    assert seen == {"per_prefix": 4, "seed": 1, "exclude": {"x"} | {q for q, _ in GENERAL}}, (
        "the trainer's own arguments pass unchanged, the general questions excluded in the draw too (an "
        "oversampled start then keeps another question in their place)"
    )
    assert retention.neighbour_prompts is draw, "the trainer's function is back after the run"


def test_losses_name_what_the_trained_model_lost_with_the_bases_lead(tmp_path):
    from recipe_facts import losses

    (q0, w0), (q1, w1), (q2, _) = GENERAL[:3]
    base = [f"It is {w0[0]}.", f"It is {w1[0]}.", "No idea."] + ["-"] * (len(GENERAL) - 3)
    trained = ["It is Brindlecourt.", f"It is {w1[0]}.", "Still none."] + ["-"] * (len(GENERAL) - 3)
    margins = [0.125, 2.0, None] + [None] * (len(GENERAL) - 3)
    row = {
        "setting": "seed=0",
        "base_general_answers": base,
        "general_answers": trained,
        "base_margins": margins,
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, setting="seed=1")) + "\n")
    text = losses([str(path)])
    assert f"`seed=0`: 1 lost: {q0} (+0.125)" in text  # q1 kept, q2 was never right
    assert f"{q0} 2" in text and q1 not in text and q2 not in text
    assert "largest base lead of an answer lost: 0.125 nats (2 losses)" in text
    # a row of an earlier version, which asked only the first questions, reads the same way
    short = dict(row, base_general_answers=base[:3], general_answers=trained[:3], base_margins=margins[:3])
    path.write_text(json.dumps(short) + "\n")
    assert f"`seed=0`: 1 lost: {q0} (+0.125)" in losses([str(path)])


def test_the_bf16_logit_view_decodes_with_the_heads_rounded_logits_and_restores_the_fp32_ones(model_root):
    """``rounded_logits`` (the bench's "with bf16 logits" column) takes ``generation.inference``'s head back to what
    autocast gives (bf16) for the batch it wraps, and only for it."""
    import torch
    from recipe_facts import rounded_logits

    from strop.common.trainer_types import LoadModelRequest
    from strop.trainer_svc.core import generation, model_loading

    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama", dtype="bfloat16"), model_root=model_root, device="cpu"
    )
    head = loaded.model.get_output_embeddings()
    seen: list[torch.dtype] = []
    hook = head.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    try:
        with rounded_logits():
            rounded, _ = generation.generate_chat_batch(
                loaded, ["Hi?", "Why?"], max_new_tokens=3, disable_adapter=True
            )
        assert seen and set(seen) == {torch.bfloat16}
        seen.clear()
        plain, _ = generation.generate_chat_batch(
            loaded, ["Hi?", "Why?"], max_new_tokens=3, disable_adapter=True
        )
        assert seen and set(seen) == {torch.float32}
    finally:
        hook.remove()
    assert len(rounded) == len(plain) == 2
