"""strop's kernels as a library: load a model, patch it, hand it to TRL.

    python -m strop.demo.library_example                         # generates a tiny Llama, 20 SFT steps
    python -m strop.demo.library_example --model path/to/llama --quantize nf4 --steps 200

On a CUDA machine the patched model runs strop's Triton kernels; on a CPU-only machine set
``TRITON_INTERPRET=1`` (before Python starts) to run the same kernels in Triton's interpreter — slow, but
the same code path. The patched and unpatched models train the same function (see tests/kernels).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from strop.common.trainer_types import DEFAULT_TARGET_MODULES


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local HF model dir (default: generate a tiny Llama)")
    p.add_argument("--quantize", choices=("none", "nf4"), default="none")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from strop.demo.data import sft_rows
    from strop.kernels.models import patch_model

    model_dir = a.model
    if model_dir is None:
        from strop.fixtures import TinyShape, make_tiny_model

        model_dir = make_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny-llama", shape=TinyShape(128, 256, 2, 4, 2)
        )
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa", "device_map": {"": "cuda:0" if cuda else "cpu"}}
    if a.quantize == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )

    # 1. load with transformers, 2. attach LoRA with PEFT, 3. patch, 4. train with TRL as usual.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model = get_peft_model(
        model,
        LoraConfig(
            r=16,
            lora_alpha=16,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=list(DEFAULT_TARGET_MODULES),
        ),
    )
    report = patch_model(model)
    print(report)

    losses: list[float] = []
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=a.steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=cuda,
        use_cpu=not cuda,
        max_length=256,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(sft_rows()), processing_class=tokenizer
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"losses: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
