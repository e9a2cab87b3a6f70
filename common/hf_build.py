"""Building a transformers model, one at a time in a process.

transformers builds every model (``from_pretrained``, ``from_config``) inside context managers that swap
process-wide state and put it back on exit: ``initialization.no_tie_weights`` replaces
``PreTrainedModel.tie_weights`` with a no-op, ``local_torch_dtype`` sets torch's default dtype,
``meta_device_safe_creation_ops`` replaces ``torch.linspace`` (transformers 5.17 - 5.24). Two threads building at
once restore each other's swaps in the wrong order, and the no-op can stay for the rest of the process: every tied
model loaded after that has its ``lm_head`` untied and left on the meta device ("lm_head.weight MISSING" in the load
report; Generate fails with "Cannot copy out of meta tensor", a forward computes from uninitialised memory). The
trainer loads sessions on gRPC threads and the exporter verifies targets on a thread pool, so both services build
through :func:`building`; :func:`check_built` refuses a model that came out of such a process anyway.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_BUILD_LOCK = threading.RLock()  # reentrant: a build that builds (PEFT on a base) may call back in


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Hold the process's one model-building turn (wrap every ``from_pretrained``/``from_config`` of a model)."""
    with _BUILD_LOCK:
        yield


def check_built(model, what: str) -> None:
    """Raise RuntimeError if ``model`` has a parameter or buffer on the meta device (no data: a load that
    silently failed to fill or tie it), naming them."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"{what} loaded with {len(meta)} tensors on the meta device (no data), e.g. {meta[:3]}: the "
            "process's transformers state was left inconsistent (PreTrainedModel.tie_weights swapped by a "
            "concurrent load outside strop.common.hf_build.building?)"
        )
