"""GPU check: does strop's patched model train like HF + PEFT from PEFT's own init (B = 0)?

A 4-layer Llama of Llama-3.1-8B's widths (random bf16 weights), LoRA r=16 alpha=16 on all seven projections
(PEFT's init, adapters upcast to fp32 as the trainer does), 4 x 2048 fixed tokens, bf16 autocast, AdamW lr 1e-4,
3 steps; each configuration starts from the same weights. Prints each configuration's per-step losses: the same
model and adapters in fp32 without autocast (the exact training), HF + PEFT, strop fully patched, and strop with
one kernel family left out at a time.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import peft
    import transformers
    from lora_grad_check import wide_llama_config

    from strop.kernels.models import patch_model

    cfg = wide_llama_config(4)
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    ids = torch.randint(0, 32000, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    configs = {
        "fp32 HF + PEFT (truth)": "fp32",
        "HF + PEFT": None,
        "strop, all kernels": {},
        "strop, no lora_mlp": {"lora_mlp": False},
        "strop, lora_mlp only": {
            "rms_norm": False,
            "rope": False,
            "lora_qkv": False,
            "lora_o": False,
            "fused_cross_entropy": False,
        },
    }
    for name, kw in configs.items():
        torch.manual_seed(2)  # the same LoRA A init for every configuration
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(cfg).to(torch.bfloat16),
            peft.LoraConfig(r=16, lora_alpha=16, target_modules=targets),
        )
        model.get_base_model().load_state_dict(state, strict=False)
        model.cuda()
        if kw == "fp32":
            model.float()
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        if isinstance(kw, dict):
            try:
                patch_model(model, **kw)
            except TypeError as e:
                print(f"{name}: {e}")
                continue
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=kw != "fp32"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 5))
        print(f"{name:24s} {losses}", flush=True)
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
