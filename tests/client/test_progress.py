"""The CLI's progress bar: its rate is the job's, from the first tick."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace as N

from strop.client.progress import follow


def _events(n: int, period: float):
    for i in range(1, n + 1):
        time.sleep(period)
        step = N(step=i, total_steps=n, loss=1.0, learning_rate=1e-3, tokens_per_second=100.0, dpo=None)
        yield N(job_id="job", step=step, state=None, checkpoint=None, adapter=None, log=None)


def test_the_rate_shown_is_never_above_the_rate_steps_arrive(capsys):
    period = 0.3  # about 3.3 steps per second
    follow(_events(4, period))
    rates = [float(r) for r in re.findall(r"([\d.]+)step/s", capsys.readouterr().err)]
    assert rates, "the bar shows a rate"
    # the true rate is 1/period; scheduling can only make steps arrive later, so the rate lower, never 2x higher
    assert max(rates) <= 2.0 / period, rates
