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


def _factors_after_a_job(
    model_root, work, scale: float, control: training.JobControl | None = None
) -> dict[str, torch.Tensor]:
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
    training.run_training(
        loaded, ROWS, DatasetFormat.TEXT, cfg, work, control or training.JobControl(), sinks
    )
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


def test_a_cancel_that_lands_while_the_adapter_is_scaled_is_too_late_to_change_how_the_job_ends(
    model_root, tmp_path, monkeypatch
):
    """The job's outcome is read after the scale: a stop asked between the two must not make a CANCELLED job whose
    published adapter is the scaled one (only a completed run's adapter is scaled)."""
    control = training.JobControl()
    real = training.scale_adapter

    def racing(loaded, scale):
        control.request_stop("cancel")  # the Cancel RPC lands after the last step, before the job's outcome
        return real(loaded, scale)

    monkeypatch.setattr(training, "scale_adapter", racing)
    _factors_after_a_job(model_root, tmp_path, 0.3, control)
    assert control.completed and control.stop is None, "the run completed: the job ends SUCCEEDED, scaled"


def test_a_stop_asked_before_the_run_completes_is_kept_and_the_run_is_not_completed():
    control = training.JobControl()
    control.request_stop("cancel")
    control.request_stop("interrupt")
    assert not control.complete() and not control.completed
    assert control.stop is not None and control.stop.reason == "cancel", "the first stop asked is the job's"


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
    kept = TrainConfig(
        method=TrainMethod.SFT, adapter_scale=1.0, keep_best_checkpoint=True, eval_every_steps=2
    )
    assert job_config.with_defaults(kept, session_max_len=64).adapter_scale == 1.0, (
        "1 is the adapter as trained"
    )
    for scale in (0.0, 0.5, 1.0):
        assert (
            job_config.with_defaults(
                TrainConfig(method=TrainMethod.SFT, adapter_scale=scale), session_max_len=64
            ).adapter_scale
            == scale
        )


def test_a_fully_trained_module_copy_moves_the_same_fraction_toward_the_base():
    """A module PEFT trains whole (``modules_to_save``: an MoE's router with ``train_router``) is interpolated as the
    LoRA pairs are: base + scale · (trained − base)."""
    from types import SimpleNamespace

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model = get_peft_model(
        net, PeftLoraConfig(r=2, lora_alpha=4, target_modules=["0"], modules_to_save=["1"])
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # as if trained: B away from its zero init, the copy away from the base
                p.add_(torch.randn_like(p))
    wrapper = model.base_model.model[1]
    base = {n: p.detach().clone() for n, p in wrapper.original_module.named_parameters()}
    trained = {n: p.detach().clone() for n, p in wrapper.modules_to_save["default"].named_parameters()}
    b = model.base_model.model[0].lora_B["default"].weight.detach().clone()
    assert training.scale_adapter(SimpleNamespace(model=model), 0.25) == 2
    torch.testing.assert_close(model.base_model.model[0].lora_B["default"].weight, b * 0.25, rtol=0, atol=0)
    for n, p in wrapper.modules_to_save["default"].named_parameters():
        torch.testing.assert_close(p, base[n] + 0.25 * (trained[n] - base[n]), rtol=1e-6, atol=1e-6)
