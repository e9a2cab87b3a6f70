"""strop's Triton kernel core: fused ops with hand-written backward passes, and model patching.

Functional ops (each file documents its formula, shapes, dtype contract and what it saves):

    rms_norm(x, weight, eps)                         RMSNorm, dW when the weight is trainable
    rope_qk(q, k, cos, sin)                          RoPE on q and k, in place, one launch
    swiglu(gate, up), geglu(gate, up, approximate)   gated activations, recomputing backward
    fused_linear_cross_entropy(hidden, weight, labels, ...)   LM-head loss without full logits
    nf4_dequantize(packed, quant_state, out=None, dtype=None), dequantize_weight(module_or_param)
    lora_linear(x, base, A, B, s, bias)              LoRA over a frozen dense or NF4 base
    lora_qkv(x, q, k, v)                             fused Q/K/V LoRA projections
    lora_mlp(x, gate, up, down, activation)          fused LoRA gated MLP
    sequence_logps(...), strop_dpo_loss(...)         chunked DPO without full logits
    tiled_mlp(...), offloaded_checkpoint(...)         long-context memory: tiled MLP, offloaded checkpointing

Model patching: ``patch_model(model) -> PatchReport`` swaps module forwards of a Llama, Mistral, Qwen2
or Qwen3 model (plain HF or PEFT-wrapped) for these ops, per instance; ``unpatch_model`` undoes it.
Parts whose fast path does not apply keep the HF/PEFT path and the report says why.
``enable_memory_features``/``disable_memory_features`` install the long-context memory machinery the
same way (see ``kernels/memory.py``); ``enable_budgeted_recompute(model, budget_bytes)`` spends spare
device memory for speed, recomputing only the layers the budget cannot hold (``kernels/recompute.py``).

The kernels run on CUDA; on a CPU-only host only under ``TRITON_INTERPRET=1`` (set before importing
this package), which is how the CPU test tier runs them.

Example (LoRA on a CUDA machine; QLoRA is the same with a ``BitsAndBytesConfig`` NF4 model)::

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from strop.kernels import patch_model

    model = AutoModelForCausalLM.from_pretrained(
        "path/to/llama", dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ))
    report = patch_model(model)
    print(report)  # what was patched, and why anything was not

    ids = torch.randint(0, model.config.vocab_size, (2, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)  # fused CE: out.loss, out.logits is None
    out.loss.backward()

Hand the patched model to TRL's ``SFTTrainer``/``DPOTrainer`` as usual: their chunked LM head
(``fused_lm_head=True`` calls) runs over the patched backbone, and calls without labels return logits.
"""

from .chunked_dpo import sequence_logps, strop_dpo_loss
from .fused_linear_ce import fused_linear_cross_entropy
from .lora_linear import LoRAProj, lora_linear, lora_qkv
from .lora_mlp import lora_mlp
from .memory import MemoryReport, disable_memory_features, enable_memory_features
from .nf4 import dequantize_weight, nf4_dequantize
from .offload import disable_offloaded_checkpointing, enable_offloaded_checkpointing, offloaded_checkpoint
from .patch import PatchReport, patch_model, unpatch_model
from .recompute import BudgetedRecompute, RecomputePlan, enable_budgeted_recompute
from .rmsnorm import rms_norm
from .rope import rope_qk
from .swiglu import geglu, swiglu
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp

__all__ = [
    "BudgetedRecompute",
    "LoRAProj",
    "MemoryReport",
    "PatchReport",
    "RecomputePlan",
    "dequantize_weight",
    "disable_memory_features",
    "disable_offloaded_checkpointing",
    "disable_tiled_mlp",
    "enable_budgeted_recompute",
    "enable_memory_features",
    "enable_offloaded_checkpointing",
    "enable_tiled_mlp",
    "fused_linear_cross_entropy",
    "geglu",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "nf4_dequantize",
    "offloaded_checkpoint",
    "patch_model",
    "rms_norm",
    "rope_qk",
    "sequence_logps",
    "strop_dpo_loss",
    "swiglu",
    "tiled_mlp",
    "unpatch_model",
]
