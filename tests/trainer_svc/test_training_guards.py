"""Training is never silently broken: Generate leaves the 4-bit layers trainable, and a step without usable
gradients, or with a non-finite loss or adapter, fails the job and names the tensors.

bitsandbytes >= 0.49 on a CPU with AVX512-BF16 repacks a ``Linear4bit`` weight the first time it runs in
eval mode without grad (``packing_format_for_cpu``); the repacked matmul has no backward. These tests
make every CPU behave like such a CPU (``has_avx512bf16`` forced true before the layers are built, as
``Linear4bit.__init__`` reads it) or put layers into the repacked state with bitsandbytes' own repack
function, so they test the same thing on every machine the tier runs on.
"""

from __future__ import annotations

import pytest
import torch

from strop.common.trainer_types import LoadModelRequest, LoraConfig
from strop.trainer_svc.core import job_config, model_loading, training
from strop.trainer_svc.core.guard import BrokenTraining

LORA = LoraConfig(r=8, alpha=16, seed=0)
PROMPT = "What is the secret password of strop?"


@pytest.fixture
def avx512bf16_cpu(monkeypatch):
    """Layers built from here on take the repacking branch bitsandbytes takes on an AVX512-BF16 CPU."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)


def _session(model_root, name="tiny-llama-4bit"):
    loaded = model_loading.load_model(LoadModelRequest(model_path=name), model_root=model_root, device="cpu")
    model_loading.attach_lora(loaded, LORA)
    return loaded


def _adapter_grads(loaded) -> dict[str, torch.Tensor]:
    model = loaded.model
    model.train()
    ids = loaded.tokenizer("The password is blue falcon seven.", return_tensors="pt")["input_ids"]
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _generate(loaded) -> None:
    model_loading.generate(
        loaded, [PROMPT], max_new_tokens=4, disable_adapter=False, apply_chat_template=True
    )


def test_generate_leaves_no_4bit_layer_repacked(model_root, avx512bf16_cpu):
    loaded = _session(model_root)
    _generate(loaded)
    assert model_loading.repacked_4bit_layers(loaded.model) == [], (
        "Generate must not repack the 4-bit weights"
    )


def test_adapter_gradients_after_generate_equal_those_without_one(model_root, avx512bf16_cpu):
    # The same weights, the same adapter seed, the same batch: the only difference is a Generate first.
    # Bitwise equal, because nothing about the computation may change.
    plain = _adapter_grads(_session(model_root))
    after = _session(model_root)
    _generate(after)
    grads = _adapter_grads(after)
    assert grads.keys() == plain.keys()
    differ = [n for n in plain if not torch.equal(grads[n], plain[n])]
    assert not differ, f"{len(differ)} adapter gradients changed after a Generate, e.g. {differ[:3]}"


def test_generate_computes_from_a_dequantized_copy_that_a_job_drops_before_training(model_root, tmp_path):
    # Generate on a CPU session uses the copy (model_loading.inference_weights); training computes from the 4-bit
    # weights themselves, so a job frees the copy first (and the gradients above stay bitwise those without one).
    loaded = _session(model_root)
    _generate(loaded)
    copy = loaded.extra.get(model_loading.INFERENCE_COPY)
    assert copy and len(copy) == 7 * loaded.facts.num_layers, "every 4-bit projection of every layer"
    cfg = job_config.with_defaults(_sft(max_steps=1), session_max_len=64)
    training.run_training(loaded, ROWS, _fmt(), cfg, tmp_path / "work", training.JobControl(), _sinks())
    assert model_loading.INFERENCE_COPY not in loaded.extra


def test_training_refuses_layers_left_in_the_repacked_layout(model_root, tmp_path):
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    loaded = _session(model_root)
    layer = loaded.model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    rows = [{"text": "The password is blue falcon seven."}] * 4
    cfg = job_config.with_defaults(_sft(max_steps=2), session_max_len=64)
    with pytest.raises(
        BrokenTraining, match=r"layers\.0\.mlp\.down_proj.*no backward|no backward.*down_proj"
    ):
        training.run_training(loaded, rows, _fmt(), cfg, tmp_path / "work", training.JobControl(), _sinks())


# ---- the gradient guard --------------------------------------------------------------------------------


def _sft(**kw):
    from strop.common.trainer_types import TrainConfig, TrainMethod

    defaults = dict(method=TrainMethod.SFT, learning_rate=2e-3, batch_size=2, lr_scheduler="constant", seed=0)
    return TrainConfig(**{**defaults, **kw})


def _fmt():
    from strop.common.trainer_types import DatasetFormat

    return DatasetFormat.TEXT


def _sinks(steps: list | None = None):
    return training.Sinks(
        on_step=(steps.append if steps is not None else lambda m: None),
        on_checkpoint=lambda step, path: None,
        on_start=lambda total: None,
    )


ROWS = [{"text": f"The password is blue falcon seven. Row {i}."} for i in range(8)]


def _train(loaded, tmp_path, **cfg):
    steps: list = []
    config = job_config.with_defaults(_sft(**cfg), session_max_len=64)
    training.run_training(
        loaded, ROWS, _fmt(), config, tmp_path / "work", training.JobControl(), _sinks(steps)
    )
    return steps


def test_healthy_training_passes_the_guard_also_when_warmup_starts_at_lr_zero(model_root, tmp_path):
    # A fresh adapter has B = 0, so every A gets an exactly zero gradient until B moves; with linear
    # warm-up the first step's lr is 0 and B moves only at step 2. Neither is a broken graph.
    loaded = _session(model_root)
    steps = _train(loaded, tmp_path, max_steps=4, lr_scheduler="linear", warmup_steps=2)
    assert [s.step for s in steps] == [1, 2, 3, 4]


def test_an_overflowing_learning_rate_fails_at_the_first_step_naming_the_tensors(model_root, tmp_path):
    # 1e308 is finite in float64 but overflows float32: AdamW's first update makes every adapter inf.
    loaded = _session(model_root)
    with pytest.raises(
        BrokenTraining,
        match=r"step 1: the optimizer step made \d+ adapter tensors non-finite: .*lora_",
    ):
        _train(loaded, tmp_path, max_steps=3, learning_rate=1e308)


def test_tensors_cut_off_from_the_loss_fail_the_job_as_missing_gradients(model_root, tmp_path):
    loaded = _session(model_root)
    attn = loaded.model.get_base_model().model.layers[1].self_attn
    q = attn.q_proj
    forward = q.forward
    q.forward = lambda x, *a, **k: forward(x, *a, **k).detach()  # a kernel without a backward
    with pytest.raises(
        BrokenTraining,
        match=r"step 1: 2 of \d+ trainable tensors got no gradient.*layers\.1\.self_attn\.q_proj",
    ):
        _train(loaded, tmp_path, max_steps=2)


def test_tensors_whose_gradient_stays_zero_fail_the_job(model_root, tmp_path):
    # The adapter's output is multiplied by zero: its tensors get gradients, all exactly zero. lora_B is
    # not exempt (its A is random), so the window's end names it.
    loaded = _session(model_root)
    lora_b = loaded.model.get_base_model().model.layers[0].mlp.up_proj.lora_B["default"]
    lora_b.register_forward_hook(lambda mod, inp, out: out * 0.0)
    with pytest.raises(
        BrokenTraining, match=r"by step 3: .*only zero gradients.*layers\.0\.mlp\.up_proj\.lora_B"
    ):
        _train(loaded, tmp_path, max_steps=5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", float("nan")),
        ("weight_decay", float("inf")),
        ("max_grad_norm", float("nan")),
        ("dpo_beta", float("inf")),
        ("warmup_ratio", float("nan")),
    ],
)
def test_non_finite_hyperparameters_are_refused_by_name(field, value):
    from strop.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=f"{field} must be a finite number"):
        job_config.with_defaults(_sft(**{field: value}), session_max_len=64)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_lora_alpha_is_refused(model_root, alpha):
    from strop.common.errors import InvalidArgument

    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
    )
    with pytest.raises(InvalidArgument, match="alpha"):
        model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=alpha))


def test_a_broken_run_over_grpc_ends_failed_never_succeeded(client, ready_session, sft_dataset):
    from strop.client import JobState
    from tests.trainer_svc.conftest import sft_config

    events = list(client.train(ready_session, sft_dataset.dataset_id, sft_config(3, learning_rate=1e308)))
    final = events[-1].state
    assert final is not None and final.state is JobState.FAILED, final
    assert "BrokenTraining" in final.message and "non-finite" in final.message and "lora_" in final.message
    job = client.get_job(events[-1].job_id)
    assert job.state is JobState.FAILED and job.adapter is None, "a broken run publishes no adapter"
    assert job.error_code == "INVALID_ARGUMENT", "the input is at fault: a pipeline should fix it, not retry"
