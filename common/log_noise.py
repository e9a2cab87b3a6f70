"""Library messages that say nothing to a service's operator, kept out of the service log.

Each entry names the message and why it is noise for strop's services (it does not hide anything that could go
wrong at run time: a real warning from the same libraries still reaches the log). Installed by ``run_main`` for
both services; ``--log-level DEBUG`` shows them again (at DEBUG, once each), for anyone tracing a library.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger name, message pattern, why it is noise)
NOISY_LOGS: tuple[tuple[str, str, str], ...] = (
    (
        "bitsandbytes.backends.cpu.ops",
        r"Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes looks for an optional Hub kernel; services run offline and bnb's own CPU path is used",
    ),
    (
        "kernels.hf_hub",
        r"Skipping publisher trust check",
        "the same Hub-kernel probe, in offline mode",
    ),
)
# (warning category, message pattern, why it is noise)
NOISY_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        r"`(is_)?gradient_checkpointing(_kwargs|_enable|_disable)?` is deprecated",
        "transformers 5.2x renamed the flag; strop sets it for every 5.x it supports (5.17 has only the old name)",
    ),
    (
        UserWarning,
        r"You passed `quantization_config` or equivalent parameters to `from_pretrained` but the model",
        "a prequantized checkpoint's own quantization config wins, which is what strop asks for",
    ),
    (
        UserWarning,  # trl's TRLExperimentalWarning subclasses it (common imports no trl)
        r"You are importing from 'trl\.experimental'",
        "ORPO and SimPO run TRL's ORPOTrainer/CPOTrainer, kept under trl.experimental in TRL 1.x; strop's parity "
        "tests (tests/trainer_svc/test_methods.py) hold them to TRL's results at the locked version",
    ),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.pattern.search(record.getMessage()):
            return True
        if not self.seen:
            self.seen = True
            logging.getLogger("strop.log_noise").debug("filtered library message: %s", record.getMessage())
        return False


def install() -> None:
    """Filter the messages above from this process's logs and warnings (idempotent)."""
    for name, pattern, _ in NOISY_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    for category, pattern, _ in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=".*" + pattern, category=category)
