"""GPU check: LoRA gradients of strop's patched model against HF + PEFT's, per parameter, at 8B widths.

A 2-layer Llama of Llama-3.1-8B's widths (hidden 4096, intermediate 14,336, 32/8 heads; random bf16 weights),
LoRA r=16 on all seven projections with fp32 adapters and non-zero B (std 0.02, so every LoRA term is live),
8 x 2048 tokens under bf16 autocast. The same model is run unpatched (HF + PEFT, plain checkpointing) and
patched (strop's kernels), with and without strop's standard memory mode; printed per parameter: the gradient's
relative difference to the unpatched one (max |diff| / max |ref|), worst first. bf16 noise is ~1e-2; a wrong
kernel shows as O(1).
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")


def wide_llama_config(layers: int):
    """A Llama config of Llama-3.1-8B's widths with ``layers`` decoder layers (32K vocabulary), SDPA attention."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def main() -> None:
    import peft
    import transformers

    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import apply_memory_mode, patch_model

    cfg = wide_llama_config(2)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    dense.save_pretrained("/tmp/lora-grad-check")
    for kind in ("bf16", "nf4"):
        if kind == "bf16":
            base = dense.cuda()
        else:
            q = transformers.BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
            base = transformers.AutoModelForCausalLM.from_pretrained(
                "/tmp/lora-grad-check",
                quantization_config=q,
                dtype=torch.bfloat16,
                attn_implementation="sdpa",
            )
        print(f"\n===== {kind} base", flush=True)
        check(base, patch_model, apply_memory_mode, MemoryMode, peft)
        del base
        torch.cuda.empty_cache()


def check(base, patch_model, apply_memory_mode, MemoryMode, peft) -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=16, target_modules=targets))
    gen = torch.Generator("cuda").manual_seed(1)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
            if "lora_B" in n:
                p.data.normal_(0, 0.02, generator=gen)
    ids = torch.randint(0, 32000, (8, 2048), device="cuda", generator=gen)

    def grads(m, checkpointing=True):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_loss, ref = grads(model)
    patched = model  # patched in place: the weights are the same (no optimizer step)
    print(patch_model(patched), flush=True)
    cases = {"patched, HF checkpointing": grads(patched)}
    from strop.kernels.models import StepShape

    apply_memory_mode(patched, MemoryMode.STANDARD, step=StepShape(*ids.shape), device="cuda")
    cases["patched, STANDARD mode"] = grads(patched)
    for name, (loss, g) in cases.items():
        errs = sorted(((g[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
        worst = sorted(ref, key=lambda k: -((g[k] - ref[k]).abs().max() / ref[k].abs().max()).item())[:8]
        print(f"\n{name}: loss {loss:.5f} vs {ref_loss:.5f}; median rel err {errs[len(errs) // 2]:.3g}")
        for k in worst:
            rel = ((g[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
            ratio = (g[k].norm() / ref[k].norm()).item()
            print(f"  {rel:8.3g}  norm ratio {ratio:7.3f}  {k}")


if __name__ == "__main__":
    main()
