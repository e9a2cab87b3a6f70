"""Model patching: patched and unpatched models train identically, fallbacks say why, unpatch restores.

Parity (CPU tier, fp32): for llama, mistral, qwen2 and qwen3, LoRA over an fp32 base and QLoRA over an
NF4 double-quantized base (reloaded through transformers' BitsAndBytesConfig, fp32 compute), identical
adapters on all seven projections with non-zero B, trained 20 AdamW steps on fixed random tokens with
the patched and with the unpatched model. Per-step losses and final adapters must agree to 1e-5
relative: both sides compute the same fp32 function and differ only in summation order and in
which products are fused (each ~1e-7 relative), which AdamW's normalised steps carry forward without
growth at lr 1e-3 over 20 steps; a wrong gradient anywhere moves the loss by far more within a step or
two.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from strop.kernels import patch_model, unpatch_model  # noqa: E402
from strop.kernels.patch import PatchReport  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 20
RTOL = 1e-5


def _config(model_type: str, **overrides):
    # Every in_features is a multiple of 64 (hidden 64, intermediate 128), so bitsandbytes' native CPU
    # kernel (which blocks per row) dequantizes the reference path correctly.
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    extra = {
        "llama": {},
        "mistral": {"sliding_window": 6},  # shorter than the sequence: the window matters
        "qwen2": {},  # q/k/v carry biases
        "qwen3": {"head_dim": 16},  # per-head q/k RMSNorm
    }[model_type]
    return transformers.AutoConfig.for_model(model_type, **{**common, **extra, **overrides})


def _model(model_type: str, qlora: bool, tmp_path, **overrides):
    torch.manual_seed(0)
    cfg = _config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    if qlora:
        model.save_pretrained(tmp_path / model_type)
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / model_type, quantization_config=quant, dtype=torch.float32, attn_implementation="sdpa"
        )
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
    return float((a.double() - b.double()).norm() / b.double().norm())


def _batches():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 300, (2, 8), generator=gen).to(DEVICE) for _ in range(4)]


def _reset(model, state):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in state:
                p.copy_(state[n])


def _check_parity(model, model_type, steps=STEPS):
    start = _adapter_state(model)
    batches = _batches()
    ref_losses = _train(model, batches, steps)
    ref_final = _adapter_state(model)
    _reset(model, start)
    report = patch_model(model)
    expected = {"rms_norm": 5 + 4 * (model_type == "qwen3"), "rope": 2, "lora_qkv": 2, "lora_o": 2,
                "lora_mlp": 2, "fused_cross_entropy": 1}  # fmt: skip
    assert {c: len(v) for c, v in report.patched.items()} == expected, report
    assert not any(report.skipped.values()), report
    losses = _train(model, batches, steps)
    unpatch_model(model)

    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), (step, a, b)
    assert ref_losses[-1] < ref_losses[0]  # it trained: the adapters moved the loss
    final = _adapter_state(model)
    for name, ref in ref_final.items():
        assert _rel(final[name], ref) <= RTOL, name
        assert _rel(ref, start[name]) > 100 * RTOL, name  # every adapter moved, B included


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_patched_model_trains_like_the_reference(model_type, qlora, tmp_path):
    _check_parity(_peft(_model(model_type, qlora, tmp_path)), model_type)


def test_gradient_checkpointing_recomputes_through_the_kernels_like_the_reference(tmp_path):
    # The trainer's setting: QLoRA with non-reentrant checkpointing, which re-runs the patched forward
    # (dequantizing again, writing dx over the recomputed norm output) inside the backward.
    model = _peft(_model("llama", True, tmp_path))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _check_parity(model, "llama", steps=4)


def test_layers_without_recompute_run_the_kernels_on_reloaded_activations_like_the_reference(tmp_path):
    # Offloaded checkpointing with save_layers: layer 0 keeps its saved activations in host memory (the
    # kernels' backward reads, and writes in place into, reloaded copies), layer 1 recomputes.
    from strop.kernels.offload import enable_offloaded_checkpointing

    model = _peft(_model("llama", True, tmp_path))
    offloader = enable_offloaded_checkpointing(
        model, offload_cpu_tensors=True, min_offload_bytes=0, save_layers=1
    )
    _check_parity(model, "llama", steps=4)
    assert offloader.stats.saved_offloaded > 0 and offloader.stats.prefetch_misses == 0, offloader.stats


def _forward_kinds(model):
    return {n: sorted(k for k in m.__dict__ if k == "forward" or k.startswith("_strop")) for n, m in model.named_modules()}  # fmt: skip


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
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
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
        model_type, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
        **({"head_dim": 64} if model_type == "qwen3" else {}),
    )  # fmt: skip
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
