"""Datasets: JSONL rows in one of TRL's formats, validated before anything trains on them, and their registry.

Formats (as TRL names them): ``text``; ``messages`` (a conversation rendered with the chat
template); ``prompt``/``completion``; ``prompt``/``chosen``/``rejected`` (preference, for DPO, ORPO and SimPO); ``prompt``/``completion``/``label``
(unpaired preference, for KTO: ``label`` true for a desirable completion, false for an undesirable one);
``messages`` ending with a user (or system/tool) turn plus any reference fields (prompts, for GRPO: the model
answers the conversation and a grader reads the answer and the row's fields, as OpenAI's reinforcement fine-tuning
rows); and ``input_ids`` (pre-tokenized SFT rows, optionally with a 0/1 ``completion_mask``; ids are checked against
the model's vocabulary when a job starts).
Prompt, completion, chosen and rejected may be strings or message lists (conversational form).
Every bad row is reported with its 1-based line number; nothing is stored unless all rows are good.
A ``messages`` row may carry function calling as OpenAI's fine-tuning format spells it: ``tools`` (function
definitions) and assistant messages with ``tool_calls`` (their content then may be null), answered by ``tool``
messages (``tool_call_id``); whether a session's chat template renders them is checked when a job starts
(``job_config.check_tools_rendered``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from strop.common import auth
from strop.common.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from strop.common.paths import confine
from strop.common.trainer_types import DatasetFormat, DatasetInfo
from strop.trainer_svc.core.store import TrainerStore

ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_REPORTED_ERRORS = 20


@dataclass
class Limits:
    max_bytes: int = 1 << 30
    max_row_bytes: int = 4 << 20
    max_rows: int = 10_000_000


@dataclass
class ValidatedDataset:
    format: DatasetFormat
    rows: list[dict]
    size_bytes: int
    sha256: str


def _check_tool_calls(calls, at: str) -> str | None:
    if not isinstance(calls, list) or not calls:
        return f"'{at}' must be a non-empty list of tool calls"
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            return f'\'{at}[{j}]\' must be {{"type": "function", "function": {{"name", "arguments"}}}}'
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"'{at}[{j}].function.name' must be a non-empty string"
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return f"'{at}[{j}].function.arguments' is not valid JSON"
        if not isinstance(args, dict):
            return f"'{at}[{j}].function.arguments' must be a JSON object (or a string holding one)"
    return None


def _check_tools(tools) -> str | None:
    if not isinstance(tools, list) or not tools:
        return "'tools' must be a non-empty list of function definitions"
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            return f'\'tools[{j}]\' must be {{"type": "function", "function": {{"name", ...}}}}'
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"'tools[{j}].function.name' must be a non-empty string"
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            return f"'tools[{j}].function.parameters' must be a JSON schema object"
    return None


def uses_tools(row: dict) -> bool:
    """Whether a row carries function calling: ``tools``, ``tool_calls`` or ``tool`` results by ``tool_call_id``."""
    msgs = row.get("messages")
    return "tools" in row or (
        isinstance(msgs, list)
        and any(isinstance(m, dict) and ("tool_calls" in m or "tool_call_id" in m) for m in msgs)
    )


def _check_messages(value, field: str, *, tool_calls: bool = False) -> str | None:
    if not isinstance(value, list) or not value:
        return f"'{field}' must be a non-empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"'{field}[{i}]' is not an object"
        if m.get("role") not in ROLES:
            return f"'{field}[{i}].role' must be one of {sorted(ROLES)}, got {m.get('role')!r}"
        if "tool_calls" in m:
            if not tool_calls:
                return f"'{field}[{i}].tool_calls': tool calls are trained in chat SFT rows (messages) only"
            if m["role"] != "assistant":
                return f"'{field}[{i}].tool_calls' belongs on assistant messages only"
            problem = _check_tool_calls(m["tool_calls"], f"{field}[{i}].tool_calls")
            if problem:
                return problem
            if m.get("content") is None:  # a message that only calls tools
                continue
        if not isinstance(m.get("content"), str):
            return f"'{field}[{i}].content' must be a string"
        if "weight" in m and (
            m["role"] != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool)
        ):
            return f"'{field}[{i}].weight' must be 0 or 1, on assistant messages only (as the OpenAI fine-tuning API)"
    return None


def _check_text_or_messages(row: dict, field: str) -> str | None:
    if field not in row:
        return f"missing '{field}'"
    value = row[field]
    if isinstance(value, str):
        return None if value.strip() or field == "prompt" else f"'{field}' is empty"
    if isinstance(value, list):
        return _check_messages(value, field)
    return f"'{field}' must be a string or a list of messages, got {type(value).__name__}"


def detect_format(row: dict) -> DatasetFormat | None:
    keys = set(row)
    if "input_ids" in keys:
        return DatasetFormat.TOKENS
    if {"chosen", "rejected"} & keys or ({"prompt", "chosen"} <= keys):
        return DatasetFormat.PREFERENCE
    if "messages" in keys:
        msgs = row["messages"]
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        if isinstance(last, dict) and last.get("role") in ROLES - {"assistant"}:
            return DatasetFormat.PROMPTS  # nothing to imitate: a prompt for the model to answer (GRPO)
        return DatasetFormat.MESSAGES
    if "label" in keys:  # TRL's unpaired preference rows; before prompt/completion, whose keys they share
        return DatasetFormat.UNPAIRED_PREFERENCE
    if "completion" in keys:
        return DatasetFormat.PROMPT_COMPLETION
    if "text" in keys:
        return DatasetFormat.TEXT
    return None


def check_row(row: dict, fmt: DatasetFormat) -> str | None:
    """The problem with ``row`` under ``fmt``, or None when it is valid."""
    if fmt is DatasetFormat.TEXT:
        if not isinstance(row.get("text"), str):
            return "missing 'text'" if "text" not in row else "'text' must be a string"
        return None if row["text"].strip() else "'text' is empty"
    if fmt is DatasetFormat.TOKENS:
        ids = row.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return (
                "missing 'input_ids'" if ids is None else "'input_ids' must be a non-empty list of token ids"
            )
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return "'input_ids' must hold non-negative integers"
        mask = row.get("completion_mask")
        if mask is not None and (
            not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask)
        ):
            return "'completion_mask' must be a list of 0/1 as long as 'input_ids'"
        return None
    if fmt is not DatasetFormat.MESSAGES and "tools" in row:
        return "'tools': function definitions are trained in chat SFT rows (messages ending with an assistant turn) only"
    if fmt is DatasetFormat.MESSAGES:
        if "messages" not in row:
            return "missing 'messages'"
        problem = _check_messages(row["messages"], "messages", tool_calls=True) or (
            _check_tools(row["tools"]) if "tools" in row else None
        )
        if problem:
            return problem
        if row["messages"][-1]["role"] != "assistant":
            return "the last message must come from the assistant (it is what the model learns to say)"
        if all(m.get("weight", 1) == 0 for m in row["messages"] if m["role"] == "assistant"):
            return "every assistant message has weight 0: the row teaches nothing"
        return None
    if fmt is DatasetFormat.PROMPTS:
        if "messages" not in row:
            return "missing 'messages'"
        problem = _check_messages(row["messages"], "messages")
        if problem:
            return problem
        if row["messages"][-1]["role"] == "assistant":
            return "the last message must be the user's (or system's): the model's answer to it is what is graded"
        return None
    if fmt is DatasetFormat.UNPAIRED_PREFERENCE and not isinstance(row.get("label"), bool):
        return "missing 'label'" if "label" not in row else "'label' must be true or false"
    fields = ("prompt", "chosen", "rejected") if fmt is DatasetFormat.PREFERENCE else ("prompt", "completion")
    for f in fields:
        problem = _check_text_or_messages(row, f)
        if problem:
            return problem
    kinds = {isinstance(row[f], str) for f in fields}
    if len(kinds) > 1:
        return f"fields {list(fields)} mix strings and message lists"
    return None


def validate_jsonl(chunks: Iterable[bytes], fmt: DatasetFormat, limits: Limits) -> ValidatedDataset:
    """Parse and validate JSONL bytes (rows may span chunks).

    Raises:
        ResourceExhausted: the data or one row exceeds the limits.
        InvalidArgument: no rows, an undetectable format, or bad rows (each listed with its line number).
    """
    digest = hashlib.sha256()
    buf = bytearray()
    size = 0
    rows: list[dict] = []
    errors: list[str] = []
    n_errors = 0
    line_no = 0

    def take(line: bytes) -> None:
        nonlocal fmt, n_errors, line_no
        line_no += 1
        if not line.strip():
            return
        if len(line) > limits.max_row_bytes:
            raise ResourceExhausted(
                f"line {line_no} is {len(line)} bytes; the limit is {limits.max_row_bytes}"
            )
        problem = None
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            row, problem = None, f"not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})"
        except RecursionError:
            row, problem = None, "JSON nested too deeply"
        if problem is None and not isinstance(row, dict):
            problem = f"a row must be a JSON object, got {type(row).__name__}"
        if problem is None and fmt is DatasetFormat.UNSPECIFIED:
            detected = detect_format(row)
            if detected is None:
                problem = (
                    f"cannot tell the format from keys {sorted(row)}: expected 'text', 'messages', "
                    "'prompt'+'completion', 'prompt'+'chosen'+'rejected', 'prompt'+'completion'+'label' or 'input_ids'"
                )
            else:
                fmt = detected
        if problem is None:
            problem = check_row(row, fmt)
        if problem is not None:
            n_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(f"line {line_no}: {problem}")
            return
        rows.append(row)
        if len(rows) > limits.max_rows:
            raise ResourceExhausted(f"more than {limits.max_rows} rows")

    for chunk in chunks:
        size += len(chunk)
        if size > limits.max_bytes:
            raise ResourceExhausted(f"dataset exceeds the size limit of {limits.max_bytes} bytes")
        digest.update(chunk)
        buf += chunk
        if len(buf) > limits.max_row_bytes and b"\n" not in buf:
            raise ResourceExhausted(f"line {line_no + 1} exceeds {limits.max_row_bytes} bytes")
        *lines, rest = bytes(buf).split(b"\n")
        buf = bytearray(rest)
        for line in lines:
            take(line)
    if buf:
        take(bytes(buf))
    if n_errors:
        more = f" (and {n_errors - len(errors)} more)" if n_errors > len(errors) else ""
        raise InvalidArgument(f"dataset has {n_errors} bad row(s): " + "; ".join(errors) + more)
    if not rows:
        raise InvalidArgument("dataset has no rows")
    return ValidatedDataset(fmt, rows, size, digest.hexdigest())


class Datasets:
    """Validated datasets: rows on disk under the state directory, records in the store."""

    def __init__(
        self, store: TrainerStore, state_dir: Path, *, data_root: Path | None, limits: Limits
    ) -> None:
        self.store, self.data_root, self.limits = store, data_root, limits
        self.dir = Path(state_dir) / "datasets"
        self.dir.mkdir(parents=True, exist_ok=True)

    def upload(
        self,
        name: str,
        fmt: DatasetFormat,
        chunks: Iterable[bytes],
        *,
        expect_bytes: int = 0,
        expect_sha256: str = "",
    ) -> DatasetInfo:
        """Validate and store an uploaded dataset; with ``expect_bytes``/``expect_sha256`` (what the client says it
        sent) a stream that ended short or differs is DataLoss and stores nothing: a client that goes away
        mid-upload ends its request stream the way a finished one does, and only the count tells them apart."""
        received = 0

        def counted() -> Iterator[bytes]:
            nonlocal received
            for chunk in chunks:
                received += len(chunk)
                yield chunk

        def short() -> DataLoss:
            return DataLoss(
                f"the upload ended after {received} of the {expect_bytes} bytes its header announced"
            )

        try:
            validated = validate_jsonl(counted(), fmt, self.limits)
        except InvalidArgument:  # a row cut in two by a stream that ended early is the stream's fault
            if expect_bytes and received < expect_bytes:
                raise short() from None
            raise
        if expect_bytes and received != expect_bytes:
            raise short()
        if expect_sha256 and validated.sha256 != expect_sha256.lower():
            raise DataLoss("the uploaded bytes' sha256 differs from the one its header announced")
        info = DatasetInfo(
            dataset_id=f"ds-{uuid.uuid4().hex[:12]}",
            name=name,
            format=validated.format,
            num_rows=len(validated.rows),
            size_bytes=validated.size_bytes,
            sha256=validated.sha256,
            created_at=time.time(),
            tenant=auth.current().tenant,
        )
        path = self.dir / f"{info.dataset_id}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for row in validated.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.store.put_dataset(info, str(path))
        return info

    def register(self, path: str, name: str, fmt: DatasetFormat) -> DatasetInfo:
        if self.data_root is None:
            raise FailedPrecondition("this service has no data root; upload the dataset instead")
        src = confine(self.data_root, path, what="dataset path")
        if not src.is_file():
            raise InvalidArgument(f"dataset path {path!r} is not a file")

        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while block := f.read(1 << 20):
                    yield block

        return self.upload(name or src.name, fmt, chunks())

    def get(self, dataset_id: str) -> DatasetInfo:
        info = self.store.get_dataset(dataset_id)[0]
        auth.check_visible(info.tenant, f"dataset {dataset_id!r}")
        return info

    def list(self) -> list[DatasetInfo]:
        me = auth.current()
        return [d for d in self.store.list_datasets() if me.can_see(d.tenant)]

    def rows(self, dataset_id: str) -> tuple[DatasetInfo, list[dict]]:
        info, path = self.store.get_dataset(dataset_id)
        auth.check_visible(info.tenant, f"dataset {dataset_id!r}")
        with open(path) as f:
            return info, [json.loads(line) for line in f if line.strip()]
