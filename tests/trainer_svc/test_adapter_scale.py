"""``adapter_scale``: the adapter a job ends with, interpolated toward the base (every LoRA B factor times the
scale once training completes, so the adapted layer is W + scale · ΔW); validated before a job starts."""

from __future__ import annotations

import math

import pytest
import torch

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import DatasetFormat, LoadModelRequest, LoraConfig, TrainConfig, TrainMethod
from strop.trainer_svc.core import job_config, model_loading, training

ROWS = [
    {"text": f"The {word} sleeps on mat number {i}."} for i, word in enumerate(("cat", "dog", "fox", "owl"))
]


def _factors_after_a_job(model_root, work, scale: float) -> dict[str, torch.Tensor]:
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    cfg = job_config.with_defaults(
        TrainConfig(
            method=TrainMethod.SFT, learning_rate=1e-2, batch_size=2, max_steps=3, seed=0, adapter_scale=scale
        ),
        session_max_len=64,
    )
    sinks = training.Sinks(lambda m: None, lambda step, path: None, lambda total: None)
    training.run_training(loaded, ROWS, DatasetFormat.TEXT, cfg, work, training.JobControl(), sinks)
    factors = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if ".lora_" in n}
    model_loading.release(loaded)
    return factors


def test_a_scaled_job_ends_with_every_b_factor_times_the_scale_and_the_a_factors_as_trained(
    model_root, tmp_path
):
    trained = _factors_after_a_job(model_root, tmp_path / "as-trained", 0.0)
    scaled = _factors_after_a_job(model_root, tmp_path / "scaled", 0.3)
    b_names = [n for n in trained if ".lora_B." in n]
    assert b_names and len(b_names) == sum(".lora_A." in n for n in trained), "one B factor per A factor"
    assert all(bool(trained[n].abs().max() > 0) for n in b_names), "three steps at lr 1e-2 move every B"
    for name, value in trained.items():
        # the same job on the same CPU: bitwise the same run; the scale is one multiplication of each B at its end
        want = value * 0.3 if ".lora_B." in name else value
        assert torch.equal(scaled[name], want), name


@pytest.mark.parametrize("scale", [-0.1, 1.5, math.nan, math.inf])
def test_an_adapter_scale_outside_0_to_1_is_refused_naming_it(scale):
    with pytest.raises(InvalidArgument, match="adapter_scale must be"):
        job_config.with_defaults(TrainConfig(method=TrainMethod.SFT, adapter_scale=scale), session_max_len=64)


def test_an_adapter_scale_with_keep_best_checkpoint_is_refused():
    cfg = TrainConfig(
        method=TrainMethod.SFT, adapter_scale=0.5, keep_best_checkpoint=True, eval_every_steps=2
    )
    with pytest.raises(InvalidArgument, match="adapter_scale interpolates"):
        job_config.with_defaults(cfg, session_max_len=64)
    for scale in (0.0, 0.5, 1.0):
        assert (
            job_config.with_defaults(
                TrainConfig(method=TrainMethod.SFT, adapter_scale=scale), session_max_len=64
            ).adapter_scale
            == scale
        )
