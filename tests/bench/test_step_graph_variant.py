"""The training bench's ``-g1`` systems (bench/lib/train_workers.py): the trainer's memory mode with
``MemoryFeatures.step_graphs`` set, and the library loop's step through a step graph, which off CUDA runs each step
eagerly and trains as the plain loop does."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from lib.harness import workload  # noqa: E402
from lib.train_workers import memory_system, step_graph, train_step  # noqa: E402

from strop.common.trainer_types import MemoryMode  # noqa: E402
from tests.kernels.models.test_offload import _ids, _lora, _tiny_llama  # noqa: E402


def test_g1_names_step_graphs_and_leaves_the_rest_of_the_name_as_it_was():
    assert memory_system("strop-standard-g1") == (MemoryMode.STANDARD, 0, None, None, None, True, None)
    assert memory_system("strop-max-speed-s2-q1-g0") == (
        MemoryMode.MAX_SPEED,
        2,
        None,
        None,
        True,
        False,
        None,
    )
    assert memory_system("strop-standard-o0-g1") == (MemoryMode.STANDARD, 0, None, None, None, True, False)
    assert memory_system("strop-standard")[5] is None, "unset: the table's row (no mode sets it)"
    assert memory_system("baseline") is None and memory_system("strop") is None
    with pytest.raises(ValueError, match="in that order"):
        memory_system("strop-standard-g1-o0")  # a misordered variant is no silent kernels-only run


def test_the_library_step_through_a_step_graph_trains_as_the_plain_step_off_cuda():
    w = workload("lora-1b", smoke=True)
    runs = []
    for graphed in (False, True):
        model = _lora(_tiny_llama())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        graph = step_graph(model) if graphed else None
        losses = [
            float(train_step(w, model, opt, {"input_ids": ids, "labels": ids}, graph))
            for ids in map(_ids, (2, 3, 2))
        ]
        runs.append((losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
        if graphed:
            assert graph.stats.eager == 3 and graph.reasons, "off CUDA: every step eager, the reason kept"
    (plain, plain_params), (stepped, stepped_params) = runs
    assert plain == stepped
    assert all(torch.equal(a, b) for a, b in zip(plain_params, stepped_params, strict=True))
