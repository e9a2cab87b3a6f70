"""A Train job's step reads nothing back from the device between launching the backward and the optimizer step
(a read there leaves the GPU idle while the host runs the clipping and the optimizer's Python), and its step
events and saved state hold what HF's own token count and the gradient guard's earlier reads gave.

Reference: the same job with HF's ``Trainer._track_num_input_tokens`` (``.item()`` after every backward) in place
of ``DeviceTokenCount``'s; its reads in that window are seen by the same counter, so the test can fail.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from strop.common.trainer_types import (
    DatasetFormat,
    KernelMode,
    LoadModelRequest,
    LoraConfig,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import job_config, model_loading, training
from strop.trainer_svc.core.guard import BrokenTraining

READS = ("item", "tolist", "__bool__", "__int__", "__float__")
# rows of different lengths: batches are padded, so the non-padding count differs from the ids' count
ROWS = [
    {"text": "The password is blue falcon seven." + " Row" * (1 + 3 * (i % 4)) + f" {i}."} for i in range(12)
]


def sft_job(model_root, **cfg):
    """A 4-bit SFT job's session and config as ``run_training`` gets them, kernels on (interpreted), so the job's
    trainer is the one a CUDA session gets (StropSFTTrainer)."""
    request = LoadModelRequest(model_path="tiny-llama-4bit", kernels=KernelMode.ON)
    loaded = model_loading.load_model(request, model_root=model_root, device="cpu")
    model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=16, seed=0))
    config = dict(method=TrainMethod.SFT, learning_rate=2e-3, batch_size=2, lr_scheduler="constant", seed=0)
    return loaded, job_config.with_defaults(TrainConfig(**{**config, **cfg}), session_max_len=64)


def _train(model_root, tmp_path, label: str, **cfg):
    """Run an SFT job's trainer as ``run_training`` builds it, recording each step's events, the state each
    checkpoint saved, and the device reads made between ``training_step``'s return and the optimizer step."""
    from transformers import TrainerCallback

    loaded, config = sft_job(model_root, **cfg)
    steps, saved, reads = [], [], []
    window = [False]

    def checkpoint(step, path):
        saved.append(json.loads((path / "trainer_state.json").read_text())["num_input_tokens_seen"])

    class Window(TrainerCallback):  # added after the guard: its on_pre_optimizer_step has run
        def on_pre_optimizer_step(self, args, state, control, **kw):
            window[0] = False

    sinks = training.Sinks(on_step=steps.append, on_checkpoint=checkpoint, on_start=lambda total: None)
    trainer = training.build_trainer(
        loaded, ROWS, DatasetFormat.TEXT, config, tmp_path / label, training.JobControl(), sinks, [Window()]
    )
    training_step = trainer.training_step

    def launched(*a, **k):
        window[0] = (
            False  # a micro-batch's forward (reads between it and its backward cost nothing measurable)
        )
        loss = training_step(*a, **k)
        window[0] = (
            True  # its backward is launched: from here to the next forward or the optimizer step, no read
        )
        return loss

    trainer.training_step = launched
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *a, **k):
            if window[0]:
                caller = sys._getframe(1)
                reads.append(f"{name} in {caller.f_code.co_name}:{caller.f_lineno}")
            return originals[name](self, *a, **k)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        trainer.train()
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    return steps, saved, reads


def test_a_train_step_reads_nothing_between_the_backward_and_the_optimizer_and_its_events_are_hfs(
    model_root, tmp_path, monkeypatch
):
    cfg = dict(max_steps=3, gradient_accumulation_steps=2, checkpoint_every_steps=2)
    steps, saved, reads = _train(model_root, tmp_path, "ours", **cfg)
    # HF's own count: .item() right after every backward
    from transformers import Trainer

    monkeypatch.setattr(training.DeviceTokenCount, "_track_num_input_tokens", Trainer._track_num_input_tokens)
    ref_steps, ref_saved, ref_reads = _train(model_root, tmp_path, "hf", **cfg)

    assert len(ref_reads) >= 2 * 3, (
        f"HF's count reads after each of the 6 backwards (the test sees it): {ref_reads}"
    )
    assert reads == [], f"device reads between the backward and the optimizer step: {reads}"

    def content(
        m,
    ):  # everything but the wall-clock fields (step_seconds, tokens/s) and the process's peak RSS
        return (m.step, m.total_steps, m.epoch, m.loss, m.learning_rate, m.grad_norm, m.tokens_seen)

    assert [s.step for s in steps] == [1, 2, 3]
    assert [content(s) for s in steps] == [content(s) for s in ref_steps], "the same step events, to the bit"
    assert saved == ref_saved and len(saved) >= 1, "each checkpoint's state holds HF's token count"
    seen = [s.tokens_seen for s in steps]
    assert all(b > a for a, b in zip([0, *seen], seen, strict=False)), seen


def test_non_finite_gradients_fail_the_step_naming_the_tensors(model_root, tmp_path):
    """The guard's gradient check, read after the optimizer step, fails the job at the step whose gradients are
    non-finite, with the gradient message (not the adapters' that the update then made non-finite)."""
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=16, seed=0))
    lora_a = loaded.model.get_base_model().model.layers[1].self_attn.v_proj.lora_A["default"].weight
    calls = []

    def nan_at_step_2(grad):
        calls.append(1)
        return grad * float("nan") if len(calls) == 2 else grad

    lora_a.register_hook(nan_at_step_2)
    config = dict(method=TrainMethod.SFT, learning_rate=2e-3, batch_size=2, lr_scheduler="constant", seed=0)
    config = job_config.with_defaults(TrainConfig(**config, max_steps=3), session_max_len=64)
    sinks = training.Sinks(on_step=lambda m: None, on_checkpoint=lambda s, p: None, on_start=lambda t: None)
    with pytest.raises(
        BrokenTraining,
        match=r"^step 2: non-finite gradients in \d+ of \d+ trainable tensors: .*lora_",
    ) as e:
        training.run_training(
            loaded, ROWS, DatasetFormat.TEXT, config, tmp_path / "w", training.JobControl(), sinks
        )
    assert e.value.code == "INVALID_ARGUMENT"
