"""What the chunked DPO and preference-loss tests share: for the TRL glue, a tiny PEFT Llama, the preference
pairs it trains on and a trainer run that records each step's loss (so strop's trainer classes can be compared
with TRL's step by step); for the GPU tier, one loss-and-gradient call with the device memory it needed."""

from __future__ import annotations

from typing import Any

import torch


def tiny_tokenizer() -> Any:
    """The 320-token BPE tokenizer of the fixtures (deterministic, nothing downloaded)."""
    from strop.fixtures.tiny_models import make_tokenizer

    return make_tokenizer("bpe", 320)


def tiny_peft_llama(tokenizer: Any) -> Any:
    """A 2-layer, 64-wide fp32 Llama (seed 0) with rank-4 LoRA on q, v, gate and down projections."""
    import peft
    import transformers

    from strop.fixtures.tiny_models import TinyShape, build_config

    shape = TinyShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(build_config("llama", shape, len(tokenizer), tokenizer)).float()
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]
    )
    return peft.get_peft_model(model, cfg)


def preference_pairs() -> list[dict[str, str]]:
    """Eight (prompt, chosen, rejected) rows."""
    return [
        {
            "prompt": f"Question {i}: what is {i} plus {i}?",
            "chosen": f" It is {2 * i}.",
            "rejected": f" Maybe {i + 3}, or not.",
        }
        for i in range(8)
    ]


def train_recording_losses(
    trainer_cls: type, args: Any, tokenizer: Any, dataset: Any, eval_dataset: Any = None
) -> tuple[Any, list[float]]:
    """Train a fresh :func:`tiny_peft_llama` with ``trainer_cls``; the trainer and each loss it computed."""
    losses: list[float] = []

    class Recording(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(loss.item())
            return loss

    trainer = Recording(
        model=tiny_peft_llama(tokenizer),
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer, losses


def cuda_loss_grad_and_extra_bytes(loss_fn, hidden: torch.Tensor, *args: Any, **kwargs: Any):
    """``loss_fn(hidden, *args, **kwargs).loss``, its gradient w.r.t. ``hidden`` and the peak CUDA memory the
    call allocated beyond what was allocated before it (the logits or chunk buffers, the saved activations)."""
    h = hidden.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = loss_fn(h, *args, **kwargs)
    (g,) = torch.autograd.grad(out.loss, h)
    torch.cuda.synchronize()
    return out.loss.detach(), g, torch.cuda.max_memory_allocated() - base
