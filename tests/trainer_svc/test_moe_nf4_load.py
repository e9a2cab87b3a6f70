"""A 4-bit Qwen3-MoE / Mixtral session quantizes its experts while it loads
(``kernels/models/moe_experts.quantizing_experts_on_load``): the NF4 codes and scales are bit for bit those of
quantizing after the load (the old path, kept as ``moe.hold_experts_in_nf4``), and the 16-bit expert bytes the
model holds at any moment of the load are at most one stack's, where quantizing after the load holds every stack's
(what the loader itself still references, and its merge temporaries, are the GPU test's device peak).

Bytes held: every time the loader sets a parameter, the bytes of the 16-bit expert stacks the model holds then (the
stacks already set plus the one arriving; a stack held in NF4 is a stride-0 placeholder of one element). Quantizing
after the load, the last stack set makes it every stack's bytes: L layers × (E·2I·H + E·H·I) elements. Quantizing
on load, each arriving stack leaves as NF4 before the next arrives: the largest stack's bytes plus one element for
each placeholder.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

from strop.common.trainer_types import LoadModelRequest, Quantization

ARCHS = ("qwen3_moe", "mixtral")
STACKS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model, quantize_4bit

    root = tmp_path_factory.mktemp("moe-nf4-load")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    for arch in ARCHS:
        make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
        # saved bf16 and loaded as a float32 session: the stacks are quantized in the session's dtype
        bf16 = make_tiny_model(
            root / f"{arch}-bf16", arch=arch, shape=shape, dtype="bfloat16", vocab_size=320
        )
        quantize_4bit(bf16, root / f"{arch}-4bit", compute_dtype="bfloat16")
    return root


@contextmanager
def _expert_bytes_held(peaks: list[int]):
    """Record, at every parameter the loader sets, the bytes of the 16-bit expert stacks held (module docstring)."""
    seen: dict[int, torch.nn.Module] = {}

    def stack_bytes(t: torch.Tensor | None) -> int:
        return 0 if t is None or t.is_meta else t.untyped_storage().nbytes()

    def observe(module, name, param):
        if name in STACKS and type(module).__name__.endswith("Experts"):
            seen[id(module)] = module
            held = stack_bytes(param) + sum(
                stack_bytes(m._parameters.get(n))
                for m in seen.values()
                for n in STACKS
                if not (m is module and n == name)
            )
            peaks.append(held)

    # registered before the load's own hook: it sees each stack as the loader hands it over
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(observe)
    try:
        yield
    finally:
        handle.remove()


def _load(root: Path, name: str, quantization: Quantization, *, on_load: bool, monkeypatch, peaks=None):
    from strop.trainer_svc.core import moe
    from strop.trainer_svc.core.model_loading import load_model

    with monkeypatch.context() as mp:
        if not on_load:  # the old path: every stack quantized by hold_experts_in_nf4 after from_pretrained
            mp.setattr(moe, "experts_in_nf4_while_loading", lambda *a: nullcontext())
        req = LoadModelRequest(model_path=name, quantization=quantization, dtype="float32")
        with _expert_bytes_held(peaks if peaks is not None else []):
            return load_model(req, model_root=root, device="cpu")


def _nf4_state(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if "_nf4_" in n}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "name,quantization",
    [("{a}", Quantization.NF4), ("{a}-4bit", Quantization.UNSPECIFIED)],
    ids=["nf4-on-load", "prequantized"],
)
def test_experts_quantized_while_loading_equal_quantized_after_and_hold_one_16_bit_stack(
    moe_root, monkeypatch, arch, name, quantization
):
    from strop.kernels.models.moe_experts import nf4_expert_modules, nf4_experts

    name = name.format(a=arch)
    old_peaks: list[int] = []
    new_peaks: list[int] = []
    old = _load(moe_root, name, quantization, on_load=False, monkeypatch=monkeypatch, peaks=old_peaks)
    new = _load(moe_root, name, quantization, on_load=True, monkeypatch=monkeypatch, peaks=new_peaks)

    ref, got = _nf4_state(old.model), _nf4_state(new.model)
    assert sorted(got) == sorted(ref) and len(ref) == 2 * 2 * 5, (
        "2 layers × 2 stacks × packed, absmax, double quant"
    )
    for n, b in ref.items():
        assert got[n].dtype == b.dtype and torch.equal(got[n], b), n
    stacks = {}
    for mod_name, module in nf4_expert_modules(new.model).items():
        for p in STACKS:
            q = nf4_experts(module, p)
            assert q.dtype == torch.float32, (
                "cast to the session's dtype before quantizing, as after the load"
            )
            assert module._parameters[p].stride() == (0, 0, 0) and not module._parameters[p].requires_grad
            stacks[f"{mod_name}.{p}"] = q.shape
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        assert torch.equal(new.model(ids).logits, old.model(ids).logits), (
            "the same weights, the same function"
        )
    assert new.facts.num_parameters == old.facts.num_parameters

    itemsize = torch.float32.itemsize  # the session's dtype, which the loader reads the stacks in
    every = sum(s[0] * s[1] * s[2] for s in stacks.values()) * itemsize
    largest = max(s[0] * s[1] * s[2] for s in stacks.values()) * itemsize
    assert max(old_peaks) == every, "quantized after the load: every 16-bit stack held at once"
    assert max(new_peaks) <= largest + len(stacks) * torch.float32.itemsize, (max(new_peaks), largest)
    assert max(new_peaks) < every / 2, "the 2-layer fixture: at most one of its four stacks at a time"


def test_a_16_bit_session_keeps_its_experts_and_the_hook_is_gone_after_the_load(moe_root, monkeypatch):
    from strop.kernels.models.moe_experts import nf4_expert_modules

    loaded = _load(moe_root, "qwen3_moe", Quantization.NONE, on_load=True, monkeypatch=monkeypatch)
    assert not nf4_expert_modules(loaded.model)
    assert not torch.nn.modules.module._global_parameter_registration_hooks, "no hook left behind"


@pytest.mark.gpu
def test_on_the_gpu_a_4bit_moe_load_peaks_at_a_few_16_bit_stacks_not_all_of_them(tmp_path, monkeypatch):
    """The device's peak while a Qwen3-MoE of 8 layers × 64 experts (1.5 GiB of bf16 experts, the largest stack
    128 MiB) loads NF4, counted from the first weight the loader sets (after transformers' allocator warm-up, a
    cache reservation of the model's size with 16-bit experts that no tensor holds). Quantizing after the load, the
    peak holds every 16-bit stack. Quantizing on load, it holds the final model (or part of it) plus at most four
    of the largest stack: the previous stack, which the loader's loop still references while it builds the next,
    and the next one's per-expert checkpoint tensors, their stacked halves and the concatenated stack (transformers
    frees each input as it goes: two at a time for gate_up). The NF4 codes of a stack, a quarter of its bytes, are
    made after the previous stack is gone. The codes are bit for bit the same on the same device."""
    import gc

    from strop.fixtures.tiny_models import TinyShape, make_tiny_model

    shape = TinyShape(
        hidden_size=1024,
        intermediate_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        num_experts=64,
        experts_per_token=8,
    )
    make_tiny_model(tmp_path / "moe", arch="qwen3_moe", shape=shape, dtype="bfloat16", vocab_size=640)
    elems = shape.num_experts * 3 * shape.intermediate_size * shape.hidden_size
    every = shape.num_layers * elems * torch.bfloat16.itemsize
    largest = shape.num_experts * 2 * shape.intermediate_size * shape.hidden_size * torch.bfloat16.itemsize

    def load(on_load: bool):
        from strop.trainer_svc.core import moe
        from strop.trainer_svc.core.model_loading import load_model

        started = []

        def first_weight(module, name, param):
            if param.is_cuda and not started:
                started.append(True)
                torch.cuda.reset_peak_memory_stats()  # the warm-up is over: weights from here on

        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        handle = torch.nn.modules.module.register_module_parameter_registration_hook(first_weight)
        try:
            with monkeypatch.context() as mp:
                if not on_load:
                    mp.setattr(moe, "experts_in_nf4_while_loading", lambda *a: nullcontext())
                req = LoadModelRequest(model_path="moe", quantization=Quantization.NF4, dtype="bfloat16")
                loaded = load_model(req, model_root=tmp_path, device="cuda")
        finally:
            handle.remove()
        codes = {n: b.cpu() for n, b in _nf4_state(loaded.model).items()}
        final = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated() - base
        del loaded
        return peak, final, codes

    old_peak, old_final, old_codes = load(on_load=False)
    new_peak, new_final, new_codes = load(on_load=True)
    g = 2**30
    print(
        f"\n16-bit experts {every / g:.2f} GiB, largest stack {largest / g:.3f} GiB; load peak after-load "
        f"{old_peak / g:.2f} GiB, on-load {new_peak / g:.2f} GiB; held after the load {old_final / g:.2f} / "
        f"{new_final / g:.2f} GiB"
    )
    assert sorted(new_codes) == sorted(old_codes) and len(old_codes) == shape.num_layers * 2 * 5
    for n, b in old_codes.items():
        assert torch.equal(new_codes[n], b), n
    assert old_peak >= every, "quantized after the load: every 16-bit stack allocated at once"
    assert new_peak <= new_final + 4 * largest, (new_peak, new_final, largest)
