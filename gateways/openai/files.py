"""OpenAI's fine-tuning file formats as the trainer's dataset rows, line for line.

The trainer's dataset validation owns the row rules (roles, string contents, assistant ``weight`` 0/1, a last
assistant message, preference fields; ``trainer_svc/core/datasets.py``) and reports each bad row by its line number.
This module only maps what OpenAI's formats spell differently, keeping every line where it was so the trainer's line
numbers are the file's:

- chat rows ``{"messages": [...]}`` pass through; a content given as a list of text parts becomes their text;
- preference rows ``{"input": {"messages"}, "preferred_output": [...], "non_preferred_output": [...]}`` become
  strop's conversational ``{"prompt", "chosen", "rejected"}`` (DPO);
- ``prompt``/``completion`` rows (OpenAI's legacy format) pass through.

- function calling passes through as the trainer's chat rows carry it: ``tools`` on the row, assistant
  ``tool_calls`` (content may be null) and ``tool`` messages with ``tool_call_id``; the trainer checks at job
  creation that the model's chat template renders them (and refuses the job, naming the row, when it does not).
  OpenAI's legacy spelling is mapped: ``functions`` become ``tools``, an assistant ``function_call`` a one-call
  ``tool_calls`` (id ``call_<message index>``), and a ``function`` message a ``tool`` message answering the latest
  call. ``parallel_tool_calls`` is dropped (a sampling switch: it changes nothing that is rendered).

What the trainer cannot train on faithfully is refused here, by line: function calling in preference rows (the
trainer trains tool calls in chat SFT rows only) and non-text content parts (images, audio).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from strop.gateways.openai.errors import bad

MAX_REPORTED = 20
TOOL_REFUSAL = "function calling is trained in chat SFT rows ('messages') only"


class RowError(ValueError):
    pass


@dataclass
class Converted:
    data: bytes  # the trainer's JSONL, one line for each line of the file
    kind: str  # "chat", "preference", "prompts" (a chat row ending with a user turn) or "prompt_completion"


def _content(value, where: str):
    if isinstance(value, list):  # OpenAI's content parts: text only
        texts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(
                    f"'{where}.content[{i}]' is a {kind!r} part; only text parts can be trained on"
                )
            texts.append(part["text"])
        return "".join(texts)
    return value  # a string, or something the trainer refuses by line


def _messages(value, where: str, *, tools: bool = True):
    if not isinstance(value, list):
        return value  # the trainer says what a message list must be
    out, last_call = [], ""
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            out.append(m)
            continue
        at = f"{where}[{i}]"
        legacy = m.get("function_call")
        if not tools and (m.get("tool_calls") or legacy or m.get("role") == "function"):
            raise RowError(f"'{at}': {TOOL_REFUSAL}")
        m = {k: v for k, v in m.items() if k not in ("function_call", "name")}
        if legacy:
            if m.get("tool_calls"):
                raise RowError(f"'{at}' has both 'function_call' and 'tool_calls'")
            last_call = f"call_{i}"
            m["tool_calls"] = [{"id": last_call, "type": "function", "function": legacy}]
        for c in m.get("tool_calls") or []:
            if isinstance(c, dict) and isinstance(c.get("id"), str):
                last_call = c["id"]
        if m.get("role") == "function":  # the legacy result message: answers the latest call
            m = {**m, "role": "tool", "tool_call_id": last_call}
        if m.get("role") == "tool" and isinstance(value[i].get("name"), str):
            m["name"] = value[i]["name"]
        if "content" in m or m.get("role") == "assistant":
            m["content"] = _content(m.get("content"), at)
        out.append(m)
    return out


def _tools(row: dict, where: str) -> dict:
    """``row`` with OpenAI's legacy ``functions`` as ``tools`` and without ``parallel_tool_calls``."""
    row = {k: v for k, v in row.items() if k != "parallel_tool_calls"}
    if "functions" in row:
        if "tools" in row:
            raise RowError(f"'{where}functions' and '{where}tools' both given; use 'tools'")
        fns = row.pop("functions")
        row["tools"] = [{"type": "function", "function": f} for f in fns] if isinstance(fns, list) else fns
    return row


def convert_row(row) -> tuple[object, str]:
    """One parsed line as the trainer's row, and its kind."""
    if not isinstance(row, dict):
        return row, ""
    if {"input", "preferred_output", "non_preferred_output"} & set(row):
        inp = row.get("input")
        if not isinstance(inp, dict) or "messages" not in inp:
            raise RowError("'input' must be an object with 'messages' (a preference row)")
        for k in ("tools", "functions"):
            if inp.get(k):
                raise RowError(f"'input.{k}': {TOOL_REFUSAL}")
        out = {"prompt": _messages(inp["messages"], "input.messages", tools=False)}
        for src, dst in (("preferred_output", "chosen"), ("non_preferred_output", "rejected")):
            if src not in row:
                raise RowError(
                    f"missing '{src}' (a preference row has input, preferred_output, non_preferred_output)"
                )
            msgs = row[src]
            if not isinstance(msgs, list) or len(msgs) != 1 or not isinstance(msgs[0], dict):
                raise RowError(f"'{src}' must be a list of exactly one assistant message")
            if msgs[0].get("role") != "assistant":
                raise RowError(f"'{src}[0].role' must be 'assistant', got {msgs[0].get('role')!r}")
            out[dst] = _messages(msgs, src, tools=False)
        return out, "preference"
    if "messages" in row:
        out = _tools(row, "")
        msgs = out["messages"] = _messages(row["messages"], "messages")
        last = msgs[-1] if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) else {}
        return out, "prompts" if last.get("role") in ("user", "system", "tool") else "chat"
    if "prompt" in row and "completion" in row:
        return row, "prompt_completion"
    return row, ""


def convert_file(raw: bytes) -> Converted:
    """The trainer's JSONL for an uploaded file, line for line (its format detected by the trainer, from the first
    row; ``kind`` says the same of the gateway's reading, for the methods' file checks).

    Raises:
        OpenAIError: 400 naming each line the gateway refuses (the trainer reports the rest the same way).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the file is not UTF-8 (byte {exc.start})", "file") from None
    lines, errors, n_errors, kind = [], [], 0, ""
    for no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            lines.append("")
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            lines.append(line)  # the trainer reports it, with its line number
            continue
        try:
            out, row_kind = convert_row(row)
        except RowError as exc:
            n_errors += 1
            if len(errors) < MAX_REPORTED:
                errors.append(f"line {no}: {exc}")
            lines.append("")
            continue
        kind = kind or row_kind
        lines.append(json.dumps(out, ensure_ascii=False))
    if n_errors:
        more = f" (and {n_errors - len(errors)} more)" if n_errors > len(errors) else ""
        raise bad(f"the file has {n_errors} bad line(s): " + "; ".join(errors) + more, "file", "invalid_file")
    return Converted("\n".join(lines).encode(), kind or "chat")
