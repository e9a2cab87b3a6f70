"""The GRPO bench's figures over its measured steps (bench/grpo_bench.py ``rates``): one statistic for the step
time and the rates, so that s/step x tokens/s gives the tokens of a step.

Session 21's call took the upper middle element of two steps (9.0 s and 2.7 s) for each list: the slow step's time
and the fast step's rate, a table row whose s/step and tokens/s disagreed by 3.3x.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from grpo_bench import rates


def test_time_and_rates_come_from_the_same_steps():
    times = [17.7, 9.0, 2.7]  # the warm-up, then two measured steps
    tokens = [66_200.0, 66_232.0, 66_232.0]
    sampled = [490.0, 512.0, 512.0]
    steps, per_step, tok_s, sampled_s = rates(times, tokens, sampled, warmup=1)
    assert steps == 2
    assert per_step == pytest.approx((9.0 + 2.7) / 2)
    assert tok_s == pytest.approx(2 * 66_232.0 / 11.7)
    assert sampled_s == pytest.approx(2 * 512.0 / 11.7)
    assert per_step * tok_s == pytest.approx(66_232.0)  # a step's tokens, which the old pair missed by 3.3x


def test_one_measured_step_is_that_step():
    assert rates([5.0, 4.0], [100.0, 80.0], [10.0, 8.0], warmup=1) == (1, 4.0, 20.0, 2.0)
