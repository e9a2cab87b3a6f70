"""GPU check of prompt sharing's gradients: a small Llama (head_dim 128, as the 8B) on CUDA, DPO-bench shapes
(4 pairs, prompt 512 + completions 512), LoRA gradients of a weighted sum of the final hidden states, shared layout
against TRL's [chosen; rejected] rows, for each SDPA backend that takes a mask, fp32 and bf16 autocast, with and
without strop's kernels. Prints each case's largest gradient difference relative to the gradient's largest value."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")


def main() -> None:
    import peft
    import transformers

    from strop.kernels.models import patch_model
    from strop.kernels.trainers.shared_prompt import share_prompts
    from tests.kernels.trainers.test_shared_prompt import _batch

    ids, am, cm = _batch(prompts=(512,) * 4, chosen=(512,) * 4, rejected=(512,) * 4, vocab=300)
    ids, am, cm = ids.cuda(), am.cuda(), cm.cuda()
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    cfg._attn_implementation = "sdpa"
    for patched in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).cuda()
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        if patched:
            patch_model(model)
        backbone = model.get_base_model().model
        shared = share_prompts(ids, am, cm, attn_implementation="sdpa")
        w = torch.randn(*ids.shape, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        valid = am.bool()

        def grads(kwargs, unshare, dtype, backend, model=model, backbone=backbone, w=w, valid=valid):
            model.zero_grad()
            pick = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
            with pick, torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                h = unshare(backbone(**kwargs).last_hidden_state).float()
            (h[valid] * w[valid]).sum().backward()
            g = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
            return h.detach(), g

        plain = {"input_ids": ids, "attention_mask": am}
        h_truth, truth = grads(plain, lambda h: h, torch.float32, [SDPBackend.MATH])
        for dtype in (torch.float32, torch.bfloat16):
            for backend in (
                None,
                SDPBackend.MATH,
                SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,
            ):
                row = []
                for name, kwargs, unshare in (
                    ("unshared", plain, lambda h: h),
                    ("shared", shared.model_kwargs(), shared.unshare),
                ):
                    try:
                        h, g = grads(kwargs, unshare, dtype, None if backend is None else [backend])
                    except RuntimeError as e:
                        row.append(f"{name}: {str(e).splitlines()[0][:60]}")
                        continue
                    err = max(((g[k] - truth[k]).abs().max() / truth[k].abs().max()).item() for k in truth)
                    h_err = (h[valid] - h_truth[valid]).abs().max().item()
                    row.append(f"{name} grad {err:.3g} hidden {h_err:.3g}")
                print(
                    f"patched={patched} {str(dtype)[6:]:8s} {'default' if backend is None else backend.name:20s} "
                    + "; ".join(row),
                    flush=True,
                )


if __name__ == "__main__":
    main()
