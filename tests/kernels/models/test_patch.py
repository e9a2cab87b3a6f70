"""Model patching: patched and unpatched models train identically, fallbacks say why, unpatch restores.

Parity (CPU tier, fp32): for llama, mistral, qwen2 and qwen3, LoRA over an fp32 base and QLoRA over an
NF4 double-quantized base (reloaded through transformers' BitsAndBytesConfig, fp32 compute), identical
adapters on all seven projections with non-zero B, trained 10 AdamW steps on fixed random tokens by the
unpatched HF + PEFT model. At every step the patched twin (same weights, copied in) computes the loss
and the gradients of the same batch, and each must agree with the reference's.

Why teacher-forced, and the bound. Both sides compute the same fp32 function and differ only in
summation order and in which products are fused. Compared step by step on the same weights, that
difference is one forward and backward of rounding: a result that passes through ``S`` sequential fp32
reductions of at most ``K`` terms each is off by at most about ``S · √K · u`` relative (u = 2⁻²⁴, the
√K of round-off that does not add up coherently), with ``S`` = 8 per layer and pass (norms, q/k/v/o,
attention, gate/up, down), twice (forward, backward), plus 4 for the head and the loss, and ``K`` the
longest reduction (hidden, intermediate or vocabulary). That is 3.7e-5 for these 2-layer models on any
CPU; measured, the worst tensor over all steps and archs is 4e-6 (AVX512, AVX2 and scalar ATen alike).
Compared as free-running trajectories instead, AdamW's m/√v turns the rounding of gradients that nearly
cancel into whole-step update differences, which is why the old end-of-run bound of 1e-5 failed on some
CPUs (1.8e-5 on AVX512) while passing on others. A wrong gradient anywhere is off by O(1) in a step.
The parity tests are marked ``parity`` and the CPU tier runs them under two ``ATEN_CPU_CAPABILITY``
values.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

from strop.common.archs import ARCHS
from strop.common.trainer_types import DEFAULT_TARGET_MODULES
from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models import patch_model, unpatch_model  # noqa: E402
from strop.kernels.models.patch import PatchReport  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = list(DEFAULT_TARGET_MODULES)
STEPS = 6  # teacher-forced: each step compares one forward + backward on the same weights
RTOL = 1e-5


def _config(model_type: str, **overrides):
    # Every in_features is a multiple of 64 (hidden 64, intermediate 128), so bitsandbytes' native CPU
    # kernel (which blocks per row) dequantizes the reference path correctly.
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    extra = {
        "llama": {},
        "mistral": {"sliding_window": 6},  # shorter than the sequence: the window matters
        "qwen2": {},  # q/k/v carry biases
        "qwen3": {"head_dim": 16},  # per-head q/k RMSNorm
    }[model_type]
    return transformers.AutoConfig.for_model(model_type, **{**common, **extra, **overrides})


def nf4_reload(model, path, attn_implementation: str = "sdpa", device_map=None):
    """``model`` saved to ``path`` and loaded back as a user loads a QLoRA base: bitsandbytes NF4, double quant,
    fp32 compute (onto ``device_map``: transformers' default where None)."""
    model.save_pretrained(path)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=quant,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
        device_map=device_map,
    )


def _model(model_type: str, qlora: bool, tmp_path, **overrides):
    torch.manual_seed(0)
    cfg = _config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    if qlora:
        model = nf4_reload(model, tmp_path / model_type)
    return model.to(DEVICE)


def _peft(model, **lora):
    torch.manual_seed(1)
    settings = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": TARGETS,
        "lora_dropout": 0.0,
        "init_lora_weights": False,
    }
    config = peft.LoraConfig(**{**settings, **lora})
    return peft.get_peft_model(model, config)


def _adapter_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _train(model, batches, steps=STEPS):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _batches():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 300, (2, 8), generator=gen).to(DEVICE) for _ in range(4)]


def _reset(model, state):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in state:
                p.copy_(state[n])


UNIT_ROUNDOFF = 2.0**-24


def parity_bound(config) -> float:
    """S · √K · u for one fp32 forward + backward of ``config`` (see the module docstring)."""
    stages = 2 * 8 * config.num_hidden_layers + 4
    longest = max(config.hidden_size, config.intermediate_size, config.vocab_size)
    return stages * longest**0.5 * UNIT_ROUNDOFF


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def expected_patched(model_type: str, layers: int) -> dict[str, int]:
    """Modules each component patches on a model of ``layers`` decoder layers, from the architecture table:
    per layer two RMSNorms (four with Gemma's sandwich norms) plus q/k norms, and the final norm."""
    arch = ARCHS[model_type]
    norms = 2 + 2 * arch.sandwich_norms + 2 * arch.qk_norm
    return {
        "rms_norm": norms * layers + 1,
        "rope": layers,
        "lora_qkv": layers,
        "lora_o": layers,
        "lora_mlp": layers,
        "moe_router": 0,
        "fused_cross_entropy": 1,
    }


def _check_parity(model, model_type, steps=STEPS, prepare_twin=None, batches=None, bound=None):
    """Train ``model`` unpatched; at every step its patched twin must give the same loss and gradients.

    ``prepare_twin(twin)`` runs after patching (checkpointing, offloading: the twin's machinery, compared
    with the plain reference); its return value is returned. ``batches`` default to :func:`_batches`,
    ``bound`` to :func:`parity_bound` of the model's config.
    """
    config = model.get_base_model().config
    bound = parity_bound(config) if bound is None else bound
    twin = copy.deepcopy(model)
    report = patch_model(twin)
    extra = prepare_twin(twin) if prepare_twin is not None else None
    expected = expected_patched(model_type, config.num_hidden_layers)
    assert {c: len(v) for c, v in report.patched.items()} == expected, report
    assert not any(report.skipped.values()), report
    model.train()
    twin.train()
    start = _adapter_state(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    batches = _batches() if batches is None else batches
    ref_losses, worst = [], (0.0, "")
    for step in range(steps):
        ids = batches[step % len(batches)]
        _reset(twin, _adapter_state(model))
        ref_loss, ref_grads = _loss_and_grads(model, ids)
        loss, grads = _loss_and_grads(twin, ids)
        assert abs(loss - ref_loss) <= bound * abs(ref_loss), (step, loss, ref_loss, bound)
        for name, ref in ref_grads.items():
            if not ref.any():  # A under a zero B: both must be exactly zero
                assert not grads[name].any(), (step, name)
                continue
            err = _rel(grads[name], ref)
            assert err <= bound, f"step {step}: {name} gradient off by {err:.3g} (bound {bound:.3g})"
            worst = max(worst, (err, name))
        opt.step()
        ref_losses.append(ref_loss)
    assert worst[0] > 0.0, "the patched path must really be a different computation"
    assert ref_losses[-1] < ref_losses[0]  # it trained: the adapters moved the loss
    for name, p in params.items():
        assert _rel(p.detach(), start[name]) > 1e-3, name  # every adapter moved, B included
    return extra


@pytest.mark.parity
@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_patched_model_trains_like_the_reference(model_type, qlora, tmp_path):
    _check_parity(_peft(_model(model_type, qlora, tmp_path)), model_type)


@pytest.mark.parity
def test_gradient_checkpointing_recomputes_through_the_kernels_like_the_reference(tmp_path):
    # The trainer's setting: QLoRA with non-reentrant checkpointing, which re-runs the patched forward
    # (dequantizing again, writing dx over the recomputed norm output) inside the backward.
    def checkpointed(twin):
        twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    _check_parity(_peft(_model("llama", True, tmp_path)), "llama", steps=4, prepare_twin=checkpointed)


@pytest.mark.parity
def test_layers_without_recompute_run_the_kernels_on_reloaded_activations_like_the_reference(tmp_path):
    # Offloaded checkpointing with save_layers: layer 0 keeps its saved activations in host memory (the
    # kernels' backward reads, and writes in place into, reloaded copies), layer 1 recomputes.
    from strop.kernels.models import enable_offloaded_checkpointing

    def offloaded(twin):
        return enable_offloaded_checkpointing(
            twin, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=1
        )

    offloader = _check_parity(
        _peft(_model("llama", True, tmp_path)), "llama", steps=4, prepare_twin=offloaded
    )
    assert offloader.stats.saved_offloaded > 0 and offloader.stats.prefetch_misses == 0, offloader.stats


def _forward_kinds(model):
    return {
        n: sorted(k for k in m.__dict__ if k == "forward" or k.startswith("_strop"))
        for n, m in model.named_modules()
    }


def test_unpatch_restores_every_original_forward_and_output():
    model = _peft(_model("qwen3", False, None))
    ids = _batches()[0]
    before_kinds = _forward_kinds(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    patch_model(model)
    assert any(_forward_kinds(model).values())
    patch_model(model, rope=False)  # re-patching undoes the first patch before applying the new one
    unpatch_model(model)
    assert _forward_kinds(model) == before_kinds  # no instance forward left behind
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    unpatch_model(model)  # a no-op on an unpatched model


def test_a_deep_copy_of_a_patched_model_runs_on_its_own_weights():
    # TRL deep-copies models (e.g. a reference policy); the copy's patched forwards must not reach back
    # into the original's modules.
    model = _peft(_model("llama", False, None))
    patch_model(model)
    ids = _batches()[0]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        before = twin(input_ids=ids, labels=ids).loss.item(), twin(input_ids=ids).logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()  # the original changes, the copy must not
        after = twin(input_ids=ids, labels=ids).loss.item(), twin(input_ids=ids).logits
        original = model(input_ids=ids, labels=ids).loss.item()
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert original != before[0]


def test_calls_without_labels_return_logits_and_generation_matches_the_reference():
    model = _peft(_model("llama", False, None))
    model.eval()
    ids = _batches()[0]
    with torch.no_grad():
        ref = model(input_ids=ids)
        ref_loss = model(input_ids=ids, labels=ids)
        ref_gen = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    patch_model(model)
    with torch.no_grad():
        out = model(input_ids=ids)
        with_labels = model(input_ids=ids, labels=ids)
        # generate: KV cache (HF's attention forward runs), patched MLPs and norms, logits_to_keep=1
        gen = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    atol = RTOL * ref.logits.abs().max().item()
    assert torch.allclose(out.logits, ref.logits, rtol=RTOL, atol=atol)
    assert torch.equal(gen, ref_gen)
    assert with_labels.logits is None  # the fused loss never builds the logits
    assert abs(with_labels.loss.item() - ref_loss.loss.item()) <= RTOL * ref_loss.loss.item()


def test_num_items_in_batch_is_the_denominator_like_hf():
    model = _peft(_model("llama", False, None))
    ids = _batches()[0]
    labels = ids.clone()
    labels[:, :3] = -100
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(37)).loss
        patch_model(model)
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(37)).loss
    assert abs(out.item() - ref.item()) <= RTOL * ref.item()


def test_disabled_adapter_runs_the_base_like_peft():
    # DPO's reference model is the base with the adapter disabled.
    model = _peft(_model("qwen2", False, None))
    ids = _batches()[0]
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=ids).logits
    patch_model(model)
    with torch.no_grad(), model.disable_adapter():
        out = model(input_ids=ids).logits
    assert torch.allclose(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


@pytest.mark.parametrize(
    ("lora", "component", "reason"),
    [
        ({"lora_dropout": 0.1}, "lora_mlp", "lora_dropout=0.1 > 0"),
        ({"use_dora": True}, "lora_qkv", "DoRA"),
    ],
    ids=["dropout", "dora"],
)
def test_fast_path_fallbacks_log_their_reason_and_keep_the_reference(lora, component, reason, caplog):
    model = _peft(_model("llama", False, None), **lora)
    ids = _batches()[0]
    with torch.no_grad():
        model.eval()  # dropout off, so the outputs compare
        ref = model(input_ids=ids).logits
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        report = patch_model(model)
    assert report.patched["lora_qkv"] == report.patched["lora_o"] == report.patched["lora_mlp"] == []
    assert all(reason in r for r in report.skipped[component].values()) and report.skipped[component]
    assert reason in caplog.text
    mlp = model.get_base_model().model.layers[0].mlp
    assert "forward" not in mlp.__dict__  # the PEFT/HF forward is what runs
    assert report.patched["rms_norm"] and report.patched["rope"]  # the rest is still patched
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.allclose(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def test_unknown_architecture_is_left_alone_with_a_reason(caplog):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        report = patch_model(model)
    assert isinstance(report, PatchReport) and report.model_type == "gpt2"
    assert all(not v for v in report.patched.values())
    assert all("not supported" in r for v in report.skipped.values() for r in v.values())
    assert "'gpt2' is not supported" in caplog.text
    assert not any(_forward_kinds(model).values())


def test_kernels_are_decided_by_where_the_model_will_run_when_told(monkeypatch):
    """Without CUDA (and outside the interpreter) a model is left unpatched, with the reason; told it will run on
    CUDA (``device=``), a model still in host memory is patched: how an FSDP2 rank patches a base it holds on the
    host until the sharding moves it to its GPU (``trainer_svc.core.fsdp.staging_device``)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    model = _peft(_model("llama", False, None))
    report = patch_model(model)
    assert not any(report.patched.values())
    assert all("parameters on cpu" in r for v in report.skipped.values() for r in v.values()), report
    report = patch_model(model, device="cpu")
    assert all("the model runs on cpu" in r for v in report.skipped.values() for r in v.values()), report
    report = patch_model(model, device="cuda:0")
    # every component a dense model has (it has no MoE router)
    assert not any(report.skipped.values()), report
    assert all(v for c, v in report.patched.items() if c != "moe_router"), report
    unpatch_model(model)


def test_runtime_dtype_mismatch_falls_back_and_says_so(caplog):
    # bf16 activations into fp32 adapters without autocast: PEFT computes the LoRA term in fp32 there,
    # which the fused path does not, so it must hand over to PEFT.
    model = _peft(_model("llama", False, None))
    model.get_base_model().to(torch.bfloat16)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    ids = _batches()[0]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    patch_model(model, rms_norm=False, rope=False, fused_cross_entropy=False)
    with caplog.at_level(logging.WARNING, logger="strop.kernels"), torch.no_grad():
        out = model(input_ids=ids).logits
    assert "PEFT computes the LoRA term in torch.float32" in caplog.text
    assert torch.equal(out, ref)


@pytest.mark.parametrize("order", ["patch_then_trl", "trl_then_patch"])
def test_composes_with_trl_fused_lm_head_in_either_order(order):
    trl_utils = locked("trl.trainer.utils")  # the locked TRL has the fused LM head this composes with
    ids = _batches()[0]
    reference = _peft(_model("llama", False, None))
    trl_utils.add_fused_lm_head(reference.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    ref = reference(input_ids=ids, labels=ids, fused_lm_head=True)

    model = _peft(_model("llama", False, None))

    def add():
        trl_utils.add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))

    if order == "patch_then_trl":
        patch_model(model)
        add()
    else:
        add()
        patch_model(model)
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert torch.allclose(
        out.log_probs, ref.log_probs, rtol=RTOL, atol=RTOL * ref.log_probs.abs().max().item()
    )
    assert abs(out.loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
    out.loss.backward()  # gradients flow through TRL's head into the patched backbone
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    plain = model(input_ids=ids, labels=ids)  # without fused_lm_head: strop's fused CE
    assert plain.logits is None and abs(plain.loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()
    unpatch_model(model)
    again = model(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's head still works unpatched
    assert abs(again.loss.item() - ref.loss.item()) <= RTOL * ref.loss.item()


# ---- GPU tier: bf16 parity on a ~1B shape -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_patched_model_trains_like_the_reference_in_bf16_at_1b(model_type):
    # ~1B: hidden 2048, intermediate 8192, 16 layers, 32/8 heads, vocab 128256; random weights, bf16
    # base, fp32 adapters, bf16 autocast, 4 steps. bf16 losses agree to 1e-2 relative (DESIGN).
    cfg = _config(
        model_type,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        **({"head_dim": 64} if model_type == "qwen3" else {}),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=torch.bfloat16
    )
    model = _peft(model.to("cuda"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 128256, (2, 1024), generator=gen).cuda() for _ in range(2)]
    start = _adapter_state(model)

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _train(model, batches, steps=4)

    ref = run()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in start:
                p.copy_(start[n])
    report = patch_model(model)
    assert not any(report.skipped.values()), report
    ours = run()
    for a, b in zip(ours, ref, strict=True):
        assert abs(a - b) <= 1e-2 * abs(b), (ours, ref)
