"""Reading ``export.db`` rows that earlier versions wrote, into today's field names.

The state database stores the export API's dataclasses with ``serde.to_dict``. Rows written before
the core used those dataclasses (up to commit fe27371) hold the core's own forms:

- requests: ``base_path`` (now ``base_model_path``); ``verify`` as ``enabled``/``heldout``/``chat``
  (now ``skip``/``heldout_texts``/``raw_question``, each the negation or a rename);
- targets: lowercase kinds, the artifact kinds (``gguf``; now the enum name ``GGUF``);
- verifications: tri-state ``tokens_match``/``chat_tokens_match``/``answer_reproduced`` and an
  optional ``answer_top1_agreement``, None for a check that did not run (``*_checked`` flags were
  added beside them; rows written with the flags but False for "not checked" read as None again);
- progress events (before commit 65f280a): ``done``/``total`` (now ``items_done``/``items_total``).

Each function takes a decoded JSON row and returns it in today's names; a row already in today's
form comes back unchanged, so every row goes through them.
"""

from __future__ import annotations

from typing import Any

from strop.common.export_types import ExportTargetKind

_KIND_BY_ARTIFACT_KIND = {k.artifact_kind: k.value for k in ExportTargetKind.known()}


def _target(d: dict[str, Any]) -> dict[str, Any]:
    kind = d.get("kind")
    return {**d, "kind": _KIND_BY_ARTIFACT_KIND.get(kind, kind)}


def _verify_options(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    if "enabled" in d:
        d["skip"] = not d.pop("enabled")
    if "heldout" in d:
        d["heldout_texts"] = d.pop("heldout")
    if "chat" in d:
        d["raw_question"] = not d.pop("chat")
    return d


def _verification(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    for flag, tri_state in (
        ("tokens_checked", "tokens_match"),
        ("chat_tokens_checked", "chat_tokens_match"),
        ("answer_checked", "answer_reproduced"),
    ):
        if flag not in d:
            d[flag] = d.get(tri_state) is not None
        if not d[flag]:  # rows of 2026-11/12 wrote False for "not checked": today that is None
            d[tri_state] = None
    if not d["answer_checked"]:
        d["answer_top1_agreement"] = None
    return d


def upgrade_request(d: dict[str, Any]) -> dict[str, Any]:
    """A stored ``ExportRequest`` row in today's field names."""
    d = dict(d)
    if "base_path" in d:
        d["base_model_path"] = d.pop("base_path")
    d["targets"] = [_target(t) for t in d.get("targets") or []]
    if isinstance(d.get("verify"), dict):
        d["verify"] = _verify_options(d["verify"])
    return d


def upgrade_result(d: dict[str, Any]) -> dict[str, Any]:
    """A stored ``ExportResult`` row (the ``results`` column, a ``result`` event) in today's field names."""
    d = dict(d)
    if isinstance(d.get("target"), dict):
        d["target"] = _target(d["target"])
    if isinstance(d.get("verification"), dict):
        d["verification"] = _verification(d["verification"])
    return d


def upgrade_progress(d: dict[str, Any]) -> dict[str, Any]:
    """A stored ``ExportProgress`` event in today's field names."""
    renamed = {"done": "items_done", "total": "items_total"}
    return {renamed.get(k, k): v for k, v in d.items()}
