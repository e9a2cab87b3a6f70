"""The TRL glue's per-step bookkeeping without module walks (``kernels/trainers/_glue.py``): the reference pass's
adapter switch against PEFT's ``disable_adapter``, its fallbacks, accelerate's unwrap asked once per model, and the
checkpointing left on where strop's offloaded checkpoint runs the layers. Each is compared bit for bit with the walk
it replaces, on a tiny fp32 Llama on the CPU; the trainers' parity tests (``tests/kernels/losses/test_dpo.py``,
``test_preference.py``) train through them against TRL."""

from __future__ import annotations

import contextlib

import pytest
import torch

from strop.common.trainer_types import DEFAULT_TARGET_MODULES
from strop.fixtures.tiny_models import TinyShape, build_config
from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models import disable_offloaded_checkpointing, enable_offloaded_checkpointing  # noqa: E402
from strop.kernels.trainers import _glue  # noqa: E402


def _model(seed: int = 0, **lora) -> torch.nn.Module:
    shape = TinyShape(hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    cfg = build_config("llama", shape, 128)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    settings = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(DEFAULT_TARGET_MODULES))
    model = peft.get_peft_model(model, peft.LoraConfig(**{**settings, **lora}))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name or "modules_to_save" in name:  # the adapter changes the output
            p.data.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.train()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(24).remainder(128).view(2, 12)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _grad_flags(model: torch.nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["plain", "modules_to_save", "inactive_second_adapter"])
def test_the_adapter_switch_gives_peft_disable_adapters_output_and_leaves_the_model_as_it_was(
    monkeypatch, layout
):
    model = _model(modules_to_save=["lm_head"] if layout == "modules_to_save" else None)
    if layout == "inactive_second_adapter":
        model.add_adapter(
            "other", peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False)
        )
    adapted = _logits(model)
    with model.disable_adapter():
        base = _logits(model)
    assert not torch.equal(adapted, base), "the adapter must change the output, else equality proves nothing"
    flags = _grad_flags(model)

    ctx = _glue.reference_adapter(model, model.peft_config, None)
    assert _glue._adapter_flags(model) is not None, "a plain LoRA model takes the flag switch"
    with ctx:
        assert torch.equal(_logits(model), base)
        assert model._adapters_disabled
    assert torch.equal(_logits(model), adapted)
    assert _grad_flags(model) == flags and not model._adapters_disabled

    # the layers are found once: a second switch walks no module and computes no adapter status
    walks = []
    real = torch.nn.Module.modules
    monkeypatch.setattr(torch.nn.Module, "modules", lambda self: walks.append(1) or real(self))
    monkeypatch.setattr(type(model), "get_model_status", lambda self: pytest.fail("status computed"))
    with _glue.reference_adapter(model, model.peft_config, None):
        pass
    assert not walks, f"{len(walks)} module walks"
    monkeypatch.undo()

    with pytest.raises(RuntimeError, match="inside"), _glue.reference_adapter(model, model.peft_config, None):
        raise RuntimeError("inside")
    assert torch.equal(_logits(model), adapted) and not model._adapters_disabled


def test_models_the_switch_does_not_cover_go_to_peft_and_trl():
    # trained biases (PEFT warns, and its forward differs), a merged layer, adapters already off: PEFT's walk
    assert _glue._adapter_flags(_model(bias="lora_only")) is None
    merged = _model()
    merged.base_model.model.model.layers[0].self_attn.q_proj.merge()
    assert _glue._adapter_flags(merged) is None
    off = _model()
    with off.disable_adapter():
        assert _glue._adapter_flags(off) is None
    # and PEFT's own context is what runs there, with the same output
    with _glue.reference_adapter(merged, merged.peft_config, None):
        reference = _logits(merged)
    with merged.disable_adapter():
        assert torch.equal(_logits(merged), reference)

    # a "ref" adapter is the reference: TRL's use_adapter switches to it
    calls = []

    @contextlib.contextmanager
    def use_adapter(model, adapter_name):
        calls.append(adapter_name)
        yield

    model = _model()
    model.add_adapter("ref", peft.LoraConfig(r=4, target_modules=list(DEFAULT_TARGET_MODULES)))
    with _glue.reference_adapter(model, model.peft_config, use_adapter):
        pass
    assert calls == ["ref"]
    # the set of adapters changed: the layers are found again
    assert _glue._adapter_flags(model) is not None
    assert model.__dict__["_strop_adapter_flags"][0][0] == ("default", "ref")


def test_an_adapter_added_again_on_other_modules_under_its_old_name_has_its_layers_switched_too():
    model = _model(target_modules=["q_proj"])
    model.add_adapter("x", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with _glue.reference_adapter(model, model.peft_config, None):  # the layers of ("default", "x") found
        pass
    model.delete_adapter("x")
    model.add_adapter("x", peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "x"])
    with model.disable_adapter():
        base = _logits(model)
    assert not torch.equal(_logits(model), base)
    with _glue.reference_adapter(model, model.peft_config, None):
        assert torch.equal(_logits(model), base)


def test_accelerate_unwraps_each_model_once():
    class Accelerator:
        def __init__(self):
            self.asked = []

        def unwrap_model(self, model):
            self.asked.append(model)
            return model

    acc, model, other = Accelerator(), _model(), _model(seed=1)
    hf = _glue.hf_model(acc, model)
    assert hf is model.get_base_model()
    assert _glue.hf_model(acc, model) is hf and _glue.unwrapped_model(acc, model) is model
    assert _glue.unwrapped_model(acc, other) is other
    assert acc.asked == [model, other]


def test_checkpointing_stays_on_for_a_reference_pass_over_offloaded_layers_with_the_same_output():
    toggled = []

    @contextlib.contextmanager
    def disable_gc(model, kwargs):
        toggled.append(kwargs)
        model.gradient_checkpointing_disable()
        try:
            yield
        finally:
            model.gradient_checkpointing_enable(kwargs)

    model = _model()
    kwargs = {"use_reentrant": False}
    model.gradient_checkpointing_enable(kwargs)
    with _glue.reference_pass(model, disable_gc, kwargs):  # torch's checkpoint: TRL's toggle
        pass
    assert toggled == [kwargs]

    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    try:
        with torch.no_grad(), disable_gc(model, kwargs):
            toggled_off = _logits(model)
        with torch.no_grad(), _glue.reference_pass(model, disable_gc, kwargs):
            layers = model.get_base_model().model.layers
            assert all(layer.gradient_checkpointing for layer in layers)
            kept_on = _logits(model)
        assert len(toggled) == 2, "strop's offloaded checkpoint: no toggle"
        assert torch.equal(kept_on, toggled_off)
        assert offloader.stats.offloaded == 0, "a no-grad pass offloads nothing"
    finally:
        disable_offloaded_checkpointing(model)
