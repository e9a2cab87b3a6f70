"""``kernels/models/step_graph.py``: a training micro-step replayed as one CUDA graph.

CPU tier: off CUDA every step runs eagerly, with the reason kept, and computes what ``fn(*inputs)[0].backward()``
computes (outputs and accumulated gradients, bit for bit). GPU tier: a LoRA Llama with strop's kernels, under bf16
autocast, replays its captured steps with the losses and gradients of the same steps run eagerly, micro-steps
accumulating and an optimizer stepping between them; a signature past ``max_graphs`` runs eagerly.
"""

from __future__ import annotations

import pytest
import torch

from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models.step_graph import StepGraph  # noqa: E402
from tests.kernels.models.test_offload import VOCAB, _ids, _lora, _tiny_llama  # noqa: E402


def _loss_fn(model):
    def fn(ids):  # the loss and a metric from the same forward (strop's fused CE returns no logits)
        out = model(input_ids=ids, labels=ids)
        return out.loss, out.loss.detach().float().square()

    return fn


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_off_cuda_every_step_is_eager_and_computes_the_forward_and_backward_it_wraps():
    model = _lora(_tiny_llama())
    ref = _lora(_tiny_llama())
    graphed = StepGraph(_loss_fn(model), _trainable(model), warmup=0)
    for seed in (2, 5):  # two micro-steps: gradients accumulate as eager ones do
        ids = _ids(seed)
        loss, metric = graphed.step(ids)
        ref_loss, ref_metric = _loss_fn(ref)(ids)
        ref_loss.backward()
        assert torch.equal(loss, ref_loss.detach()) and torch.equal(metric, ref_metric)
        assert not loss.requires_grad, "the outputs are detached: the backward has run"
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{name}: accumulated gradient"
    assert graphed.stats.eager == 2 and graphed.stats.replayed == 0 and not graphed.graphs
    assert list(graphed.reasons.values()) == ["not one CUDA device (cpu)"]
    graphed.zero_grads()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "zeroed in place"


def test_as_if_capturing_makes_transformers_take_its_capture_paths_for_the_duration():
    from transformers.utils import import_utils

    from strop.kernels.models.step_graph import as_if_capturing

    mask = torch.ones(2, 5, dtype=torch.long)
    assert not import_utils.is_tracing(mask)
    with as_if_capturing():
        assert import_utils.is_tracing(mask), "as under a capture: no read of the mask back to the host"
    assert not import_utils.is_tracing(mask)


def test_random_free_is_true_only_without_any_dropout():
    from strop.kernels.models.step_graph import random_free

    assert random_free(_lora(_tiny_llama()))
    assert not random_free(_lora(_tiny_llama(), dropout=0.1)), "LoRA dropout"
    assert not random_free(_lora(_tiny_llama(attention_dropout=0.1))), "the config's attention dropout"
    # Mixtral's block scales the router's input by uniform noise in training; GPT-2-style dropout names
    assert not random_free(_lora(_tiny_llama(router_jitter_noise=0.01))), "router jitter"
    assert not random_free(_lora(_tiny_llama(resid_pdrop=0.1))), "resid_pdrop"
    assert random_free(_lora(_tiny_llama(router_jitter_noise=0.0)))


def _cuda_model(seed: int = 0):
    from strop.kernels.models import patch_model

    model = _lora(_tiny_llama(layers=2, seed=seed)).cuda()
    patch_model(model, device="cuda")
    return model


def _micro_steps(model, batches, graphed: StepGraph | None):
    """Micro-steps accumulating into ``.grad``: their losses and the trainable gradients after them."""
    losses = []
    for ids in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            if graphed is None:
                loss, _ = _loss_fn(model)(ids)
                loss.backward()
            else:
                loss, _ = graphed.step(ids)
        losses.append(loss.detach().clone())
    return losses, [p.grad.clone() for p in _trainable(model)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_replayed_steps_train_as_the_same_steps_run_eagerly():
    """Four optimizer steps of two micro-steps; before each, an eager twin takes the graphed model's weights and runs
    the same micro-steps: each comparison is of one step on the same weights (AdamW's first steps move every weight
    by about lr whatever its gradient's size, so rounding-level differences between two separately trained models
    grow into differences of the next gradients that bound nothing about the replay)."""
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (2, 64), generator=gen).cuda() for _ in range(8)]
    model, twin = _cuda_model(), _cuda_model()
    params, twin_params = _trainable(model), _trainable(twin)
    graphed = StepGraph(_loss_fn(model), params, warmup=2)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for i in range(0, len(batches), 2):
        with torch.no_grad():
            for p, q in zip(params, twin_params, strict=True):
                q.copy_(p)
                q.grad = None
        losses, grads = _micro_steps(model, batches[i : i + 2], graphed)
        eager_losses, eager_grads = _micro_steps(twin, batches[i : i + 2], None)
        # a replay launches the eager step's kernels in its order on the same values: the same bits, unless a
        # library picks another algorithm on the capture stream (one product's bf16 rounding then differs): allow a
        # few bf16 ulps of the loss, and of each gradient's largest element
        for a, b in zip(losses, eager_losses, strict=True):
            assert (a - b).abs() <= 4 * 2**-8 * b.abs(), (
                f"micro-steps {i}+: loss {a.item()} vs eager {b.item()}"
            )
        for j, (g, r) in enumerate(zip(grads, eager_grads, strict=True)):
            scale = r.abs().max().clamp(min=1e-30)
            assert (g - r).abs().max() <= 4 * 2**-8 * scale, f"micro-steps {i}+, parameter {j}"
        opt.step()
        graphed.zero_grads()
    assert graphed.reasons == {}, graphed.reasons
    assert graphed.stats.eager == 2 and graphed.stats.replayed == 6, graphed.stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_signatures_past_max_graphs_run_eagerly_with_the_reason():
    model = _cuda_model()
    graphed = StepGraph(_loss_fn(model), _trainable(model), warmup=0, max_graphs=1)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        for width in (32, 32, 48):
            graphed.step(torch.randint(0, VOCAB, (2, width), device="cuda"))
    assert len(graphed.graphs) == 1 and graphed.stats.replayed == 2 and graphed.stats.eager == 1
    assert list(graphed.reasons.values()) == ["1 signatures captured already"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_step_that_makes_the_host_wait_runs_eagerly_and_trains_as_eager_steps():
    """A step with a host read of the loss is not captured (the step before the capture shows the sync, so no capture
    is begun that the driver would invalidate): it and the next of another signature run eagerly, with the reason,
    give the eager steps' gradients exactly, and CUDA's RNG and the allocator's cache work afterwards."""

    def syncing(model):
        plain = _loss_fn(model)

        def fn(ids):
            loss, metric = plain(ids)
            if loss.item() != loss.item():  # a host read: not capturable
                raise AssertionError("NaN loss")
            return loss, metric

        return fn

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, w), generator=gen).cuda() for w in (32, 32, 48)]
    grads = []
    for graph in (False, True):
        model = _cuda_model()
        graphed = StepGraph(syncing(model), _trainable(model), warmup=0) if graph else None
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            for ids in batches:
                if graphed is None:
                    syncing(model)(ids)[0].backward()
                else:
                    graphed.step(ids)
        grads.append([p.grad.clone() for p in _trainable(model)])
        if graph:
            assert graphed.failed and "makes the host wait" in graphed.failed, graphed.failed
            assert graphed.stats.replayed == 0 and graphed.stats.eager == 3 and not graphed.graphs
            torch.randn(4, device="cuda")  # no generator left capturing
            torch.cuda.empty_cache()  # no capture left under way
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), "a failed capture changed no gradient"
