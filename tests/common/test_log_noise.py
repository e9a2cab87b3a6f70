"""The service log keeps library noise out and every other message in."""

from __future__ import annotations

import logging
import warnings

from strop.common import log_noise
from tests.deps import locked


def test_noisy_library_messages_are_dropped_and_real_ones_kept(caplog):
    log_noise.install()
    log_noise.install()  # idempotent: one filter per logger
    assert sum(isinstance(f, log_noise._Drop) for f in logging.getLogger("kernels.hf_hub").filters) == 1
    with caplog.at_level(logging.INFO):
        bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: offline. Please make sure")
        logging.getLogger("kernels.hf_hub").warning("Skipping publisher trust check for 'x' because offline")
        bnb.warning("a real problem in the 4-bit CPU path")
    messages = [r.getMessage() for r in caplog.records if r.name != "strop.log_noise"]
    assert messages == ["a real problem in the 4-bit CPU path"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        log_noise.install()  # after simplefilter, as a process's start-up order would have it
        warnings.warn(
            "`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1
        )
        warnings.warn(
            "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
            FutureWarning,
            stacklevel=1,
        )
        warnings.warn(  # TRL's TRLExperimentalWarning(UserWarning), as ORPO/SimPO jobs import it
            "You are importing from 'trl.experimental'. APIs here are unstable and may change or be removed "
            "without notice. Silence this warning by setting environment variable TRL_EXPERIMENTAL_SILENCE=1.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("`other_flag` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`other_flag` is deprecated"]


def test_dataset_progress_bars_stay_out_of_the_service_log():

    datasets = locked("datasets")
    from strop.trainer_svc.core.training import quiet_dataset_progress

    datasets.enable_progress_bars()
    quiet_dataset_progress()  # what every job's trainer build does
    assert not datasets.is_progress_bar_enabled()
