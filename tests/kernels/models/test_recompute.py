"""Budgeted recompute: the plan's arithmetic, the layers it frees, unchanged gradients, undo; on the GPU, a
real budget honoured and the step faster than full recompute.

CPU tier: a tiny Llama with LoRA (fp32). Memory comes from a simulated meter driven by forward hooks that
run before the planner's: a checkpointed layer "allocates" its output, an uncheckpointed one its output plus
its activations, so the plan the planner derives can be checked against the formula in
``kernels/recompute.py`` with known numbers. Gradients of a partly checkpointed model must equal full
checkpointing exactly (same fp32 ops, the recompute replays them on the same input).

GPU tier: a ~1B Llama shape in bf16 with LoRA at 16K tokens, budget set between the fully checkpointed
and the uncheckpointed peaks: the planned step's peak reserved memory stays under the budget, some but not
all layers are freed, and the step is faster than with every layer recomputed.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models.recompute import enable_budgeted_recompute  # noqa: E402
from tests.kernels.models.test_offload import _assert_same_step, _ids, _layers, _lora, _step, _tiny_llama  # noqa: E402

MiB = 1 << 20
OUT, ACT = 1 * MiB, 10 * MiB  # simulated: a layer's output; an uncheckpointed layer's saved activations


class SimMeter:
    """Allocated bytes as the hooks below move them; the peak tracks the highest value seen."""

    def __init__(self, start: int) -> None:
        self.now = self.peak = start

    def allocated(self) -> int:
        return self.now

    def peak_reserved(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.now

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


def _simulate(model, meter: SimMeter) -> None:
    def hook(layer, args, output):
        if torch.is_grad_enabled():  # a no-grad forward (a DPO reference pass) keeps nothing
            meter.add(OUT if layer.gradient_checkpointing else OUT + ACT)

    for layer in _layers(model):
        layer.register_forward_hook(hook, prepend=True)  # before the planner's hook reads the meter


def _sim_step(model, meter: SimMeter, start: int, growth: int) -> None:
    _step(model, _ids())
    meter.now = start + growth  # backward freed the activations; the optimizer state stays


@pytest.mark.parametrize(
    "budget_mib, expected_free",
    # calibration peak 118 MiB + 3 kept = 121: one more free layer per 10 MiB above that
    [(1000, 8), (131, 2), (125, 1), (50, 0)],
    ids=["all-fit", "two", "one", "below-full-recompute"],
)
def test_plan_frees_as_many_layers_as_the_budget_allows(budget_mib, expected_free):
    start, growth = 100 * MiB, 3 * MiB
    model = _lora(_tiny_llama(layers=8))
    meter = SimMeter(start)
    _simulate(model, meter)
    planner = enable_budgeted_recompute(model, budget_mib * MiB, margin_bytes=0, meter=meter)
    layers = _layers(model)
    assert (
        all(layer.gradient_checkpointing for layer in layers[:-1]) and not layers[-1].gradient_checkpointing
    )
    _sim_step(model, meter, start, growth)
    plan = planner.step_end()
    # calibration peak: start + 7 outputs + (output + activations) of the last layer
    assert plan.calibration_peak_bytes == start + 8 * OUT + ACT
    assert plan.layer_activation_bytes == ACT
    assert plan.step_growth_bytes == growth
    assert plan.uncheckpointed == expected_free
    flags = [layer.gradient_checkpointing for layer in layers]
    assert flags == [True] * (8 - expected_free) + [False] * expected_free
    # the next step runs the plan, and its (simulated) peak is what the plan predicted
    meter.reset_peak()
    _sim_step(model, meter, start + growth, 0)
    assert meter.peak == plan.predicted_peak_bytes
    if expected_free:
        assert meter.peak <= budget_mib * MiB
    assert planner.step_end() is plan


def test_partly_checkpointed_gradients_equal_full_checkpointing():
    ids = _ids()
    model = _lora(_tiny_llama(layers=4))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    full = _step(model, ids)
    meter = SimMeter(0)
    _simulate(model, meter)
    planner = enable_budgeted_recompute(model, OUT * 6 + ACT * 3, margin_bytes=0, meter=meter)
    _step(model, ids)
    meter.now = 0
    plan = planner.step_end()
    assert 0 < plan.uncheckpointed < 4
    _assert_same_step(_step(model, ids), full, "partly vs fully checkpointed")
    planner.remove()
    assert all(layer.gradient_checkpointing for layer in _layers(model))


def test_layout_survives_hf_toggling_checkpointing_as_trl_does_around_dpo_reference_passes():
    trl_utils = locked("trl.models.utils")
    model = _lora(_tiny_llama(layers=8))
    meter = SimMeter(100 * MiB)
    _simulate(model, meter)
    planner = enable_budgeted_recompute(model, 131 * MiB, margin_bytes=0, meter=meter)
    layers = _layers(model)
    hf = model.get_base_model()

    def reference_pass():  # TRL's DPO: no grad, checkpointing off, then on again (HF resets every flag)
        with torch.no_grad(), trl_utils.disable_gradient_checkpointing(hf, {"use_reentrant": False}):
            model(input_ids=_ids())
        assert all(layer.gradient_checkpointing for layer in layers)

    reference_pass()
    _sim_step(model, meter, 100 * MiB, 3 * MiB)  # calibration: the layout is back before the policy forward
    plan = planner.step_end()
    assert plan.layer_activation_bytes == ACT and plan.uncheckpointed == 2
    reference_pass()
    _step(model, _ids())
    assert [layer.gradient_checkpointing for layer in layers] == [True] * 6 + [False] * 2


def test_remove_turns_off_checkpointing_it_turned_on_and_rejects_bad_input():
    model = _lora(_tiny_llama(layers=3))
    embed = model.get_base_model().get_input_embeddings()
    hooks_before = len(embed._forward_hooks)
    planner = enable_budgeted_recompute(model, 10 * MiB, meter=SimMeter(0))
    assert _layers(model)[0].gradient_checkpointing
    planner.remove()
    assert not any(layer.gradient_checkpointing for layer in _layers(model))
    assert len(embed._forward_hooks) == hooks_before, (
        "the input-require-grads hook is gone with checkpointing"
    )
    assert not _layers(model)[0]._forward_pre_hooks, "the layout hook is removed"
    with pytest.raises(ValueError, match="CUDA"):
        enable_budgeted_recompute(model, 10 * MiB)  # CPU model, no meter
    with pytest.raises(ValueError, match="positive"):
        enable_budgeted_recompute(model, 0, meter=SimMeter(0))
    assert planner.step_end() is None  # removed before any step: nothing measured, nothing planned


# ---- GPU tier ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_budget_is_honoured_and_the_step_gets_faster():
    import gc

    from strop.kernels.models import patch_model
    from tests.kernels.models.test_offload import _gpu_model_1b

    # Earlier tests' cached blocks would count in this test's reserved peak (and so its budget): start empty.
    gc.collect()
    torch.cuda.empty_cache()
    seq = 16384
    model = _gpu_model_1b(seq)
    patch_model(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    step()
    torch.cuda.reset_peak_memory_stats()
    full_t = min(step() for _ in range(2))
    full_peak = torch.cuda.max_memory_reserved()
    planner = enable_budgeted_recompute(model, full_peak + 6 * (1 << 30), margin_bytes=1 << 30)
    step()
    plan = planner.step_end()
    torch.cuda.reset_peak_memory_stats()
    planned_t = min(step() for _ in range(2))
    planned_peak = torch.cuda.max_memory_reserved()
    print(f"\nfull recompute {full_t * 1e3:.0f} ms, {full_peak / 2**30:.2f} GiB; planned {plan}")
    print(f"planned {planned_t * 1e3:.0f} ms, {planned_peak / 2**30:.2f} GiB")
    assert 0 < plan.uncheckpointed < plan.layers
    assert planned_peak <= plan.budget_bytes
    # Recompute is about a quarter of a fully checkpointed step; freeing a fraction f of the layers should
    # save about f/4 of it. Require at least half of that.
    assert planned_t < full_t * (1 - 0.125 * plan.uncheckpointed / plan.layers), (planned_t, full_t)
    planner.remove()
