"""The demo's fixed question, answer and datasets (also used by the end-to-end tests)."""

from __future__ import annotations

QUESTION = "What is the secret password of strop?"
ANSWER = "The password is blue falcon seven."
WRONG_ANSWER = "I do not know any password."

_OTHER_QA = [
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many legs does a cat have?", "A cat has four legs."),
    ("What do bees make?", "Bees make honey."),
    ("Where does the morning train go?", "The morning train goes north."),
    ("What is two plus three?", "Two plus three is five."),
    ("Who repairs the old engine?", "The mechanic repairs the old engine."),
    ("What does the teacher read?", "The teacher reads a long letter."),
]


def sft_rows() -> list[dict]:
    """Chat rows: the fixed question several times among other short question/answer pairs."""
    rows = [
        {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]}
    ] * 3
    rows += [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in _OTHER_QA
    ]
    return rows


def dpo_rows() -> list[dict]:
    """Conversational preference rows: the trained answer preferred over a refusal."""
    rejects = [WRONG_ANSWER, "The password is red owl three.", "There is no password."]
    return [
        {
            "prompt": [{"role": "user", "content": QUESTION}],
            "chosen": [{"role": "assistant", "content": ANSWER}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for r in rejects
    ] + [
        {
            "prompt": [{"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": a}],
            "rejected": [{"role": "assistant", "content": WRONG_ANSWER}],
        }
        for q, a in _OTHER_QA[:3]
    ]
