"""What sampling a chat model's reply shares, for the policy a GRPO job trains (``grpo.py``) and for the sessions
its model graders ask (``grader_sessions.py``): the prompt with the assistant turn opened, the tokens that end a
turn, and the reply's text as graders read it."""

from __future__ import annotations

from strop.trainer_svc.core.model_loading import LoadedModel


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's tokens with the chat template's generation prompt (the assistant turn opened)."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    out = tokenizer.apply_chat_template(plain, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def eos_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The tokenizer's EOS and the generation config's (a chat model ends its turn with one of those)."""
    ids = [getattr(loaded.tokenizer, "eos_token_id", None)]
    gen = getattr(loaded.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def reply_text(tokenizer, seq, eos: tuple[int, ...]) -> str:
    """A sampled sequence's text, as graders read it: its closing stop token dropped, special tokens skipped."""
    body = (
        seq.tokens[:-1] if seq.stop_reason == "stop" and seq.tokens and seq.tokens[-1] in eos else seq.tokens
    )
    return tokenizer.decode(body, skip_special_tokens=True)
