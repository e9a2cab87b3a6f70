"""The MoE tests' shared setup: the Qwen3-MoE / Mixtral / gpt-oss configs, LoRA on attention and the fused expert
stacks, one step's loss and gradients, and the relative error they compare with."""

from __future__ import annotations

import torch

from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

# the CPU tests' shape: 2 layers, 4 experts of which 2 are routed, the router's aux loss in the loss
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)


def moe_config(
    model_type: str, common: dict = TINY, *, dense: int = 128, expert: int = 64, experts: int = 4, **qwen3
):
    """A ``model_type`` config of ``common`` with ``experts`` experts of width ``expert`` (Qwen3-MoE's dense
    width ``dense``; ``qwen3`` are Qwen3-MoE's other fields)."""
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=dense, moe_intermediate_size=expert, num_experts=experts, **qwen3
        )
    cls = transformers.MixtralConfig if model_type == "mixtral" else transformers.GptOssConfig
    return cls(**common, intermediate_size=expert, num_local_experts=experts)


def expert_lora(model, r: int = 4, alpha: int = 8):
    """``model`` under PEFT with seeded, non-zero LoRA on q/k/v/o and on the fused expert parameters."""
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    return peft.get_peft_model(model, lora)


def loss_and_grads(model, ids):
    """One teacher-forced step on ``ids``: (loss, router aux loss, every trainable parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.item(), out.aux_loss.item(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
