"""Offloaded activation checkpointing: same gradients as plain checkpointing, the reload schedule, fallbacks,
installation into HF/PEFT models and its undo; on the GPU, the memory it saves and the time it costs.

CPU tier: a tiny Llama built from a config in code (hidden 64, 3 layers, 4 heads / 2 KV heads, vocab 300),
fp32. With ``offload_cpu_tensors=True`` the offload path runs with a host copy standing in for the pinned
buffer, so the schedule (save, prefetch, fetch) is the one CUDA runs; gradients must equal both plain
checkpointing and no checkpointing *exactly*: the recompute runs the same fp32 ops on a bit-identical copy
of the input, and each parameter gets one gradient contribution per step either way.

GPU tier: a ~1B Llama shape (hidden 2048, 16 layers) in bf16 with LoRA at 16K tokens: offload must cut
peak memory by most of the checkpointed inputs and cost at most 15 % step time over plain checkpointing.
"""

from __future__ import annotations

import functools
import logging
import time

import pytest
import torch

from strop.common.trainer_types import DEFAULT_TARGET_MODULES
from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

import strop.kernels.models.offload_records as records_mod  # noqa: E402
from strop.kernels.models import (  # noqa: E402
    ActivationOffloader,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offloaded_checkpoint,
)
from strop.kernels.models.memory import disable_memory_features, enable_memory_features  # noqa: E402

B, T, H, LAYERS, VOCAB = 2, 37, 64, 3, 300


def _tiny_llama(layers: int = LAYERS, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).float().train()


def _lora(model: torch.nn.Module, dropout: float = 0.0) -> torch.nn.Module:
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=list(DEFAULT_TARGET_MODULES),
    )
    model = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B, so the LoRA path changes the output and its A gets a gradient
            p.data.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.train()


def _ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _step(
    model: torch.nn.Module, ids: torch.Tensor, seed: int = 3
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step (fixed RNG seed, so dropout masks repeat across runs)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(actual, expected, what: str) -> None:
    loss, grads = actual
    loss_ref, grads_ref = expected
    assert torch.equal(loss, loss_ref), f"{what}: loss {loss.item()} != {loss_ref.item()}"
    assert grads.keys() == grads_ref.keys(), f"{what}: different parameters got gradients"
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), (
            f"{what}: {name} gradient differs by {(g - grads_ref[name]).abs().max().item():.3g} "
            "(same fp32 ops on a bit-identical input must give identical gradients)"
        )


def _layers(model) -> list[torch.nn.Module]:
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(hf.model.layers)


def _checkpoint_funcs(model) -> list:
    return [layer.__dict__.get("_gradient_checkpointing_func") for layer in _layers(model)]


# ---- gradients -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora_dropout", [None, 0.0, 0.1], ids=["full", "lora", "lora-dropout"])
def test_offloaded_gradients_equal_plain_and_no_checkpointing(lora_dropout):
    model = _tiny_llama()
    if lora_dropout is not None:
        model = _lora(model, lora_dropout)
    ids = _ids()
    no_ckpt = _step(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = _step(model, ids)
    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    offloaded = _step(model, ids)
    # 2 of 3 layers offload (the last keeps its input); dropout masks replay from the saved RNG state
    assert offloader.stats.offloaded == LAYERS - 1
    _assert_same_step(offloaded, plain, "offloaded vs plain checkpointing")
    _assert_same_step(offloaded, no_ckpt, "offloaded vs no checkpointing")


def test_lora_params_get_gradients_without_input_require_grads():
    # Checkpointing turned on by the offloader itself: HF's enable_input_require_grads never ran, so the
    # embedding output does not require grad; the anchor input must still route gradients to LoRA.
    model = _lora(_tiny_llama())
    ids = _ids()
    expected = _step(model, ids)
    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    got = _step(model, ids)
    assert offloader.stats.offloaded == LAYERS - 1
    assert any("lora_A" in n for n in got[1]), "LoRA parameters received no gradient"
    _assert_same_step(got, expected, "offloaded (no input grads) vs no checkpointing")


# ---- schedule --------------------------------------------------------------------------------------------


def test_reload_of_previous_layer_is_issued_before_current_layer_recomputes():
    model = _tiny_llama()
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, trace=True
    )
    trace = offloader.stats.trace
    for i, layer in enumerate(model.model.layers):  # runs inside the checkpointed forward and its recompute
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: trace.append(("compute", i)))
    _step(model, _ids())
    expected = [
        ("save:offload", 0),
        ("compute", 0),
        ("save:offload", 1),
        ("compute", 1),
        ("save:keep", 2),
        ("compute", 2),
        # backward: the last layer's input never left; layer 1's reload starts before layer 2 recomputes
        ("fetch:kept", 2),
        ("prefetch", 1),
        ("compute", 2),
        ("fetch:hit", 1),
        ("prefetch", 0),
        ("compute", 1),
        ("fetch:hit", 0),
        ("compute", 0),
    ]
    assert trace == expected
    s = offloader.stats
    layer_input_bytes = B * T * H * 4
    assert (s.prefetch_hits, s.prefetch_misses) == (2, 0), "both offloaded inputs should be prefetched"
    assert s.peak_host_bytes == 2 * layer_input_bytes, (
        "two layer inputs live in host memory at the end of forward"
    )
    assert s.host_bytes == 0, "every host copy is released once reloaded"


def test_host_memory_is_released_when_the_graph_is_dropped_without_backward():
    model = _tiny_llama()
    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    assert offloader.stats.host_bytes == 2 * B * T * H * 4
    del loss
    assert offloader.stats.host_bytes == 0, "dropping the graph must free the host copies it owned"


def test_gradient_accumulation_over_two_micro_batches_equals_no_checkpointing():
    model = _lora(_tiny_llama())
    ids_a, ids_b = _ids(5), _ids(6)

    def two_steps():
        model.zero_grad(set_to_none=True)
        for ids in (ids_a, ids_b):
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = two_steps()
    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    got = two_steps()
    assert offloader.stats.prefetch_misses == 0, "each micro-batch's chain must prefetch its own inputs"
    for name, g in got.items():
        assert torch.equal(g, expected[name]), f"{name}: accumulated gradient differs"


# ---- layers without recompute: saved activations in host memory ----------------------------------------


@pytest.mark.parametrize("lora_dropout", [None, 0.1], ids=["full", "lora-dropout"])
def test_saved_layers_give_the_gradients_of_no_checkpointing(lora_dropout):
    model = _tiny_llama()
    if lora_dropout is not None:
        model = _lora(model, lora_dropout)
    ids = _ids()
    expected = _step(model, ids)
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=LAYERS
    )
    got = _step(model, ids)
    s = offloader.stats
    # layers 0 and 1 run without recompute (the last keeps its input and recomputes)
    assert s.offloaded == 0 and s.saved_offloaded > 0 and s.saved_kept > 0, s
    assert s.host_bytes == 0, "every host copy is released once reloaded"
    assert (s.prefetch_hits, s.prefetch_misses) == (2, 0), s
    assert s.saved_prefetched == s.saved_offloaded, "every saved activation was reloaded ahead of need"
    _assert_same_step(got, expected, "saved-activation layers vs no checkpointing")


def test_saved_layer_is_not_recomputed_and_its_reload_is_issued_before_the_layer_above_recomputes():
    model = _tiny_llama()
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=1, trace=True
    )
    trace = offloader.stats.trace
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: trace.append(("compute", i)))
    _step(model, _ids())
    expected = [
        ("save:offload", 0),
        ("compute", 0),
        ("compute", 1),
        ("save:activations", 1),
        ("save:keep", 2),
        ("compute", 2),
        # backward: layer 1's activations start coming back before layer 2 recomputes; layer 1 itself is
        # never recomputed, and reaching it starts layer 0's input reload
        ("fetch:kept", 2),
        ("prefetch", 1),
        ("compute", 2),
        ("fetch:hit", 1),
        ("prefetch", 0),
        ("fetch:hit", 0),
        ("compute", 0),
    ]
    assert trace == expected


def test_a_tensor_saved_by_two_ops_is_copied_once_and_parameters_stay_put():
    w = torch.nn.Parameter(torch.randn(6, 6))
    x = torch.randn(4, 6, requires_grad=True)

    def fn(h):
        a = (h @ w).sin()  # mm saves h and w (a parameter), sin saves h @ w
        return a * a  # mul saves a twice: one copy

    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    out = offloaded_checkpoint(fn, x, offloader=offloader, save=True)
    s = offloader.stats
    assert (s.saved_offloaded, s.saved_kept) == (3, 1), s  # h, h @ w, a; w kept
    assert s.host_bytes == 3 * 4 * 6 * 4
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    ex, ew = torch.autograd.grad(fn(x).sum(), (x, w))
    torch.testing.assert_close(gx, ex, rtol=0, atol=0)
    torch.testing.assert_close(gw, ew, rtol=0, atol=0)
    assert s.host_bytes == 0


def test_weights_saved_as_views_stay_put_and_views_of_one_activation_are_copied_once():
    frozen = torch.nn.Parameter(torch.randn(6, 6), requires_grad=False)
    w1, w2 = torch.nn.Parameter(torch.randn(3, 6)), torch.nn.Parameter(torch.randn(3, 6))
    x = torch.randn(2, 4, 6, requires_grad=True)

    def fn(h):
        y = h * 2
        # each linear reshapes y to its own 2-D view; the trainable ones save that view (for their weight
        # gradient) and every one saves its weight transposed (for the input gradient)
        lin = torch.nn.functional.linear
        return lin(y, w1).sum() + lin(y, w2).sum() + lin(y, frozen).sum()

    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    out = offloaded_checkpoint(fn, x, offloader=offloader, save=True)
    s = offloader.stats
    assert (s.saved_offloaded, s.saved_kept) == (1, 3), s  # y's views: one copy; three weight views kept
    assert s.host_bytes == 8 * 6 * 4, s
    grads = torch.autograd.grad(out, (x, w1, w2))
    expected = torch.autograd.grad(fn(x), (x, w1, w2))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_in_place_writes_to_saved_activations_raise_like_autograd():
    x = torch.randn(4, 6, requires_grad=True)

    def write_after_save(h):
        a = h.exp()  # exp saves its output a
        b = a.exp()
        a.mul_(2)  # in place on a tensor backward needs
        return b

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        write_after_save(x).sum().backward()  # plain autograd: the behaviour to match
    for min_bytes in (0, 1 << 20):  # offloaded, then kept on its device
        offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=min_bytes)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            offloaded_checkpoint(write_after_save, x, offloader=offloader, save=True).sum().backward()
        assert (offloader.stats.saved_offloaded > 0) == (min_bytes == 0), offloader.stats


def test_keyword_tensors_stay_put_and_dense_views_keep_their_strides():
    shared = torch.randn(8, 6)
    x = torch.randn(6, 8, requires_grad=True)

    def fn(h, *, table):
        v = (h + 0).t()  # a transposed view: dense, not contiguous; sin saves it
        return (v.sin() * table).sum()

    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    seen = []
    orig = records_mod.SavedGroup.unpack

    def spy(group, handle):
        out = orig(group, handle)
        seen.append((tuple(out.shape), out.stride()))
        return out

    records_mod.SavedGroup.unpack = spy
    try:
        out = offloaded_checkpoint(functools.partial(fn, table=shared), x, offloader=offloader, save=True)
        (gx,) = torch.autograd.grad(out, (x,))
    finally:
        records_mod.SavedGroup.unpack = orig
    (ex,) = torch.autograd.grad(fn(x, table=shared), (x,))
    torch.testing.assert_close(gx, ex, rtol=0, atol=0)
    assert ((8, 6), (1, 8)) in seen, "the transposed view comes back with its strides"
    assert offloader.stats.saved_kept >= 1, "the keyword tensor (alive for the whole forward) is not copied"


def test_an_exception_in_a_saved_layer_leaves_no_host_memory_behind():
    import gc

    x = torch.randn(64, 64, requires_grad=True)

    def boom(h):
        h.exp().sin()
        raise MemoryError("simulated OOM")

    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    gc.disable()
    try:
        with pytest.raises(MemoryError):
            offloaded_checkpoint(boom, x, offloader=offloader, save=True)
        assert offloader.stats.host_bytes == 0, "no cycle keeps the host copies of a failed layer alive"
    finally:
        gc.enable()


def test_second_backward_through_an_offloaded_layer_says_why():
    x = torch.randn(4, 6, requires_grad=True)
    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    out = offloaded_checkpoint(lambda h: h.sin() * 2, x, offloader=offloader)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.sum().backward()


def test_saved_layer_host_memory_is_released_when_the_graph_is_dropped():
    model = _tiny_llama()
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=2
    )
    loss = model(input_ids=_ids(), labels=_ids()).loss
    assert offloader.stats.host_bytes > 0
    del loss
    assert offloader.stats.host_bytes == 0, "dropping the graph must free the host copies it owned"


def test_spread_picks_evenly_spaced_layers_and_bad_counts_are_refused():
    from strop.kernels.models.checkpointing import spread

    assert spread(list(range(9)), 3) == [1, 4, 7]
    assert spread(list(range(31)), 31) == list(range(31))
    assert spread([0, 1], 5) == [0, 1] and spread([0, 1], 0) == []
    assert len(set(spread(list(range(31)), 16))) == 16
    with pytest.raises(ValueError, match="save_layers"):
        enable_offloaded_checkpointing(_tiny_llama(), save_layers=-1)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        ActivationOffloader(max_inflight_bytes=-1)


# ---- fallbacks -------------------------------------------------------------------------------------------


def test_cpu_inputs_fall_back_to_plain_recompute_with_logged_reason(caplog):
    model = _lora(_tiny_llama())
    ids = _ids()
    expected = _step(model, ids)
    with caplog.at_level(logging.INFO, logger="strop.kernels"):
        offloader = enable_offloaded_checkpointing(model)  # defaults: CPU tensors are not copied
        got = _step(model, ids)
    assert offloader.stats.offloaded == 0
    reasons = offloader.stats.kept
    assert sum(reasons.values()) == LAYERS
    assert any("input on the CPU" in r for r in reasons), reasons
    assert "input on the CPU" in caplog.text, "the fallback reason must be logged"
    _assert_same_step(got, expected, "plain-recompute fallback vs no checkpointing")


def test_small_inputs_stay_on_device_below_min_offload_bytes():
    model = _tiny_llama()
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=B * T * H * 4 + 1
    )
    _step(model, _ids())
    assert offloader.stats.offloaded == 0
    assert any("min_offload_bytes" in r for r in offloader.stats.kept), offloader.stats.kept


def test_a_host_budget_offloads_the_inputs_it_holds_and_keeps_the_rest_on_the_device():
    model = _tiny_llama()
    ids = _ids()
    expected = _step(model, ids)
    size = B * T * H * 4  # one layer input (fp32)
    offloader = enable_offloaded_checkpointing(
        model,
        offload_cpu_tensors=True,
        min_offload_bytes=0,
        keep_last=0,
        host_budget_bytes=2 * size,
        trace=True,
    )
    got = _step(model, ids)
    s = offloader.stats
    # in forward order: two inputs fill the budget, the third recomputes from its device copy
    assert [e for e in s.trace if e[0].startswith("save:")] == [
        ("save:offload", 0),
        ("save:offload", 1),
        ("save:keep", 2),
    ]
    assert s.host_full == 1 and s.peak_host_bytes == 2 * size and s.host_bytes == 0
    assert any("host_budget_bytes" in r for r in s.kept), s.kept
    _assert_same_step(got, expected, "host-budgeted offload vs no checkpointing")
    disable_offloaded_checkpointing(model)
    with pytest.raises(ValueError, match="host_budget_bytes"):
        enable_offloaded_checkpointing(model, host_budget_bytes=-1)


def test_a_host_budget_keeps_a_saved_layers_activations_on_the_device_once_full():
    model = _lora(_tiny_llama(), 0.0)
    ids = _ids()
    expected = _step(model, ids)
    budget = B * T * H * 4 + 1  # room for layer 0's input only: layer 1 is saved (no recompute), layer 2 kept
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=1, host_budget_bytes=budget
    )
    got = _step(model, ids)
    s = offloader.stats
    assert s.offloaded == 1 and s.saved_offloaded == 0 and s.saved_kept > 0 and s.host_full > 0, s
    assert s.peak_host_bytes <= budget
    _assert_same_step(got, expected, "saved layer kept on the device vs no checkpointing")
    disable_offloaded_checkpointing(model)


def test_pinned_copies_count_as_the_power_of_two_blocks_they_take():
    from strop.kernels.models.host_pool import HostPool

    off = HostPool(host_budget_bytes=3 << 20)
    assert off.host_room(3 << 20, pinned=False) and not off.host_room(3 << 20)  # a 3 MiB copy pins 4 MiB
    off.hold_host(1 << 20)
    assert off.host_room((1 << 20, 1 << 20)) and not off.host_room((1 << 20, 1 << 20, 1))
    off.release_host(1 << 20)
    assert off.stats.host_bytes == 0 and off.host_room(2 << 20)


def test_keyword_tensor_requiring_grad_runs_torch_checkpoint(caplog):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)

    def layer(h, *, weight):
        return torch.tanh(h @ weight)

    expected = torch.autograd.grad(layer(x, weight=w).sum(), (x, w))
    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        out = offloaded_checkpoint(functools.partial(layer, weight=w), x, offloader=offloader)
    got = torch.autograd.grad(out.sum(), (x, w))
    assert offloader.stats.offloaded == 0 and offloader.stats.torch_checkpoint, offloader.stats
    assert "requires grad" in caplog.text
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_tuple_outputs_and_extra_positional_inputs_keep_structure_and_gradients():
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 6, requires_grad=True)

    def fn(a, b):
        return (a * b, None, a.sum(-1))

    offloader = ActivationOffloader(offload_cpu_tensors=True, min_offload_bytes=0)
    out = offloaded_checkpoint(fn, x, y, offloader=offloader)
    assert isinstance(out, tuple) and out[1] is None and out[0].shape == (4, 6) and out[2].shape == (4,)
    gx, gy = torch.autograd.grad((out[0].sum() + 2 * out[2].sum()), (x, y))
    torch.testing.assert_close(gx, y.detach() + 2, rtol=0, atol=0)  # d/da (a·b + 2·Σa) = b + 2
    torch.testing.assert_close(gy, x.detach(), rtol=0, atol=0)
    assert offloader.stats.offloaded == 1


# ---- installation ----------------------------------------------------------------------------------------


def test_trainer_style_disable_enable_cycle_keeps_offloaded_function():
    # HF Trainer calls gradient_checkpointing_enable at train start; TRL's disable_gradient_checkpointing
    # disables and re-enables around reference forwards. Both go through _set_gradient_checkpointing.
    model = _lora(_tiny_llama())
    offloader = enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0)
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in _layers(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    funcs = _checkpoint_funcs(model)
    assert all(getattr(f, "func", None) == offloader.checkpoint for f in funcs), funcs
    _step(model, _ids())
    assert offloader.stats.offloaded == LAYERS - 1


def test_disable_restores_hf_function_and_flags():
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = _checkpoint_funcs(model)
    enable_offloaded_checkpointing(model)
    assert _checkpoint_funcs(model) != before
    assert disable_offloaded_checkpointing(model) is True
    assert _checkpoint_funcs(model) == before, "HF's checkpoint function must come back"
    assert "_set_gradient_checkpointing" not in model.__dict__
    assert disable_offloaded_checkpointing(model) is False, "second disable is a no-op"

    fresh = _tiny_llama()
    enable_offloaded_checkpointing(fresh)
    assert all(layer.gradient_checkpointing for layer in fresh.model.layers), "offload turns checkpointing on"
    disable_offloaded_checkpointing(fresh)
    assert not any(layer.gradient_checkpointing for layer in fresh.model.layers), "and off again on disable"
    assert _checkpoint_funcs(fresh) == [None] * LAYERS


def test_only_layers_hf_checkpoints_are_offloaded_and_the_last_of_them_keeps_its_input():
    model = _tiny_llama(layers=4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.model.layers[3].gradient_checkpointing = False  # as every_n_layers leaves some layers unchecked
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, trace=True
    )
    _step(model, _ids())
    saves = [e for e in offloader.stats.trace if e[0].startswith("save")]
    assert saves == [("save:offload", 0), ("save:offload", 1), ("save:keep", 2)]


def test_enable_memory_features_installs_both_and_gradients_stay_equal():
    model = _lora(_tiny_llama())
    ids = _ids()
    expected = _step(model, ids)
    report = enable_memory_features(model, tiled_mlp_chunks=3, offload_cpu_tensors=True, min_offload_bytes=0)
    got = _step(model, ids)
    assert report.offloader.stats.offloaded == LAYERS - 1
    assert len(report.tiled_mlp.tiled) == LAYERS
    assert report.host_memory()["peak_host_bytes"] == (LAYERS - 1) * B * T * H * 4
    assert "on:" in report.summary()["tiled_mlp"] and "on:" in report.summary()["offload_activations"]
    loss, grads = got
    # The tiled MLP regroups the token sums of its weight gradients: fp32 rounding, not bit equality.
    torch.testing.assert_close(loss, expected[0], rtol=1e-6, atol=0)
    for name, g in grads.items():
        ref = expected[1][name]
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    disable_memory_features(model)
    mlp = model.base_model.model.model.layers[0].mlp
    assert (
        "forward" not in mlp.__dict__ and "_set_gradient_checkpointing" not in model.get_base_model().__dict__
    )


# ---- GPU tier --------------------------------------------------------------------------------------------


def _gpu_model_1b(seq: int, model_type: str = "llama"):
    """A ~1B shape with LoRA in bf16 on CUDA: Llama's, or with ``model_type="qwen3"`` the same with Qwen3's per-head
    q/k norm."""
    cfg = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(
            torch.bfloat16
        )
    return _lora(model)


def _gpu_step_stats(model, ids, steps: int = 3) -> tuple[float, float, float]:
    """Median step seconds, peak allocated bytes over the steps, and the last loss."""
    times, loss = [], None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2], torch.cuda.max_memory_allocated(), float(loss)


@pytest.mark.gpu
def test_gpu_offload_cuts_peak_memory_and_overlaps_copies():
    seq = 16384
    model = _gpu_model_1b(seq)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain_t, plain_peak, plain_loss = _gpu_step_stats(model, ids)
    offloader = enable_offloaded_checkpointing(model)
    off_t, off_peak, off_loss = _gpu_step_stats(model, ids)
    layer_input = seq * 2048 * 2
    assert offloader.stats.offloaded == 4 * 15, "15 of 16 layers offload in each of the 4 steps"
    assert offloader.stats.prefetch_misses == 0, "every reload after the kept last layer is prefetched"
    # Plain checkpointing holds 16 layer inputs, offload about two. Expect at least 12 inputs' worth saved.
    assert plain_peak - off_peak >= 12 * layer_input, (plain_peak / 2**30, off_peak / 2**30)
    assert off_t <= 1.15 * plain_t, (
        f"offload step {off_t:.3f}s vs plain {plain_t:.3f}s: copies not overlapped"
    )
    assert abs(off_loss - plain_loss) <= 1e-3 * abs(plain_loss), "forward must be unchanged by offloading"
    assert offloader.stats.peak_host_bytes >= 15 * layer_input


@pytest.mark.gpu
def test_gpu_layers_without_recompute_reload_ahead_of_need_and_train_the_same():
    # Half of the ~1B shape's layers keep their activations in host memory instead of recomputing: the
    # forward must be unchanged, every reload prefetched, and GPU memory must grow by at most a couple of
    # layers' activations (one layer reloaded + one in flight, plus the forward's copy backlog bound).
    seq = 16384
    model = _gpu_model_1b(seq)
    ids = torch.randint(0, 32000, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    offloader = enable_offloaded_checkpointing(model)
    off_t, off_peak, off_loss = _gpu_step_stats(model, ids)
    disable_offloaded_checkpointing(model)
    saver = enable_offloaded_checkpointing(model, save_layers=8, max_inflight_bytes=1 << 30)
    save_t, save_peak, save_loss = _gpu_step_stats(model, ids)
    s = saver.stats
    assert offloader.stats.prefetch_misses == 0 and s.prefetch_misses == 0, (offloader.stats, s)
    assert s.saved_offloaded > 0 and s.saved_prefetched == s.saved_offloaded, s
    assert s.host_bytes == 0, "every host copy is released by the end of the step"
    assert abs(save_loss - off_loss) <= 1e-3 * abs(off_loss), "forward must be unchanged"
    layer_input = seq * 2048 * 2
    # one unpatched HF + PEFT layer saves ≈ 8 hidden-size tensors (norm inputs and outputs, q/k/v, attention
    # output, o_proj input) + 4 intermediate-size ones (gate, silu(gate), up, their product)
    layer_activations = layer_input * (8 + 4 * 5632 / 2048)
    assert save_peak - off_peak <= 2 * layer_activations + (1 << 30), (save_peak / 2**30, off_peak / 2**30)
    print(
        f"\n1B shape, {seq} tokens: offload {off_t * 1e3:.0f} ms ({off_peak / 2**30:.2f} GiB), "
        f"8 of 16 layers without recompute {save_t * 1e3:.0f} ms ({save_peak / 2**30:.2f} GiB), "
        f"host peak {s.peak_host_bytes / 2**30:.2f} GiB, copy waits {s.copy_waits}"
    )


# ---- recompute without the down projection ---------------------------------------------------------------


def count_down_projections(monkeypatch) -> dict[str, int]:
    """Count the fused MLP's down-projection GEMMs (``["n"]``; gate/up go in as a pair, down alone)."""
    import strop.kernels.lora.mlp as mlp_mod

    downs = {"n": 0}
    real = mlp_mod.forward_projections

    def counting(x, projs, *args, **kw):
        downs["n"] += len(projs) == 1
        return real(x, projs, *args, **kw)

    monkeypatch.setattr(mlp_mod, "forward_projections", counting)
    return downs


def test_patched_mlps_skip_the_down_projection_in_recompute_with_bitwise_equal_gradients(monkeypatch):
    """A checkpointed layer's recompute never reads its output; the patched MLP (the layer's last op) skips
    its down GEMM there. Gradients equal the full recompute's bit for bit, and the down GEMM runs once per
    layer (the forward) instead of twice."""
    import contextlib

    import strop.kernels.models.offload as offload_mod
    from strop.kernels.models import patch_model

    model = _lora(_tiny_llama())
    report = patch_model(model)
    assert len(report.patched["lora_mlp"]) == LAYERS, report
    downs = count_down_projections(monkeypatch)
    ids = _ids()
    enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0, keep_last=0)
    skipped = _step(model, ids)
    assert downs["n"] == LAYERS, f"{downs['n']} down GEMMs: the recompute ran them again"
    downs["n"] = 0
    monkeypatch.setattr(offload_mod, "recompute_outputs_unused", contextlib.nullcontext)
    full = _step(model, ids)
    assert downs["n"] == 2 * LAYERS
    _assert_same_step(skipped, full, "skipping the down projection in recompute")
    disable_offloaded_checkpointing(model)


def test_the_recompute_takes_u_d_and_the_cast_adapter_factors_from_the_forward(monkeypatch):
    """What a layer's forward stashes for its recompute (kernels/lora/stash.py): the down adapter's u_d = h A_dᵀ, so
    no activation pass runs in any layer's recompute, and each LoRA Function's adapter factors in the compute
    dtype (q/k/v, o, gate/up and down: four a layer), so the recompute casts none. Loss and gradients are bitwise
    those of a recompute that computes both again (the same ops on the same inputs)."""
    import strop.kernels.lora.linear as linear_mod
    import strop.kernels.lora.mlp as mlp_mod
    import strop.kernels.models.offload as offload_mod
    from strop.kernels.models import patch_model

    model = _lora(_tiny_llama())
    patch_model(model)
    acts, taken = [0], []
    real_act, real_take = mlp_mod._act_fwd, linear_mod.take_stashed

    def act(*args, **kw):
        acts[0] += 1
        return real_act(*args, **kw)

    def take(tag):
        got = real_take(tag)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(mlp_mod, "_act_fwd", act)
    monkeypatch.setattr(linear_mod, "take_stashed", take)
    ids = _ids()
    enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0, keep_last=0)
    stashed = _step(model, ids)
    assert acts == [LAYERS], f"{acts[0]} activation passes: the recompute made h again"
    assert sum(taken) == 4 * LAYERS, taken
    acts[0], taken[:] = 0, []
    # a forward that stashes nothing: the recompute makes h for u_d and casts the factors, as before the stash
    real_record = offload_mod.recording_for_recompute
    monkeypatch.setattr(offload_mod, "recording_for_recompute", lambda stash: real_record(None))
    remade = _step(model, ids)
    assert acts == [2 * LAYERS] and not any(taken)
    _assert_same_step(stashed, remade, "u_d and factors from the stash")
    disable_offloaded_checkpointing(model)


def test_the_recompute_takes_the_projections_specs_from_the_forward(monkeypatch):
    """Each patched forward reads its projections' specs (proj_spec.layer_spec: the base, the active adapter, its
    scale) in the layer's forward and stashes them; the recompute takes them back instead of reading the modules
    again: seven reads a layer (q, k, v, o, gate, up, down) instead of fourteen, loss and gradients bit for bit
    those of a recompute that reads them again."""
    import strop.kernels.models.offload as offload_mod
    import strop.kernels.models.patched_forwards as forwards_mod
    from strop.kernels.models import patch_model

    model = _lora(_tiny_llama())
    patch_model(model)
    reads, real_spec = [0], forwards_mod.layer_spec

    def spec(*args, **kw):
        reads[0] += 1
        return real_spec(*args, **kw)

    monkeypatch.setattr(forwards_mod, "layer_spec", spec)
    ids = _ids()
    enable_offloaded_checkpointing(model, offload_cpu_tensors=True, min_offload_bytes=0, keep_last=0)
    stashed = _step(model, ids)
    assert reads == [7 * LAYERS], f"{reads[0]} spec reads: the recompute read the modules again"
    reads[0] = 0
    real_record = offload_mod.recording_for_recompute
    monkeypatch.setattr(offload_mod, "recording_for_recompute", lambda stash: real_record(None))
    reread = _step(model, ids)
    assert reads == [14 * LAYERS]
    _assert_same_step(stashed, reread, "specs from the stash")
    disable_offloaded_checkpointing(model)


def test_a_recompute_stash_hands_items_back_by_tag_in_order():
    from strop.kernels.lora.stash import RecomputeStash

    stash = RecomputeStash()
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((2,), 2.0)
    stash.put(("op", 1), a)
    stash.put(("other", 1), b)
    stash.put(("op", 1), c)
    assert len(stash) == 3
    assert stash.take(("other", 1)) is b
    assert stash.take(("op", 1)) is a
    assert stash.take(("op", 1)) is c
    assert stash.take(("op", 1)) is None  # none left: the op computes the value itself
    assert stash.take(("op", 2)) is None and len(stash) == 0
