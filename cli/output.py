"""Output shared by the CLI's commands."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from strop.common.serde import to_dict


def print_json(obj: Any) -> None:
    """An SDK dataclass (or plain value) as indented JSON on stdout."""
    print(json.dumps(to_dict(obj) if dataclasses.is_dataclass(obj) else obj, indent=2, default=str))
