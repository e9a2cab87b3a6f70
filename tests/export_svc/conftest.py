"""Shared, session-scoped fixtures of the export tests: tiny models, adapters, and trained adapters.

Everything is generated here (nothing downloaded). The expensive pieces are built once per session:

- ``export_models`` (the root conftest's, built by ``build_export_models``): a model root holding tiny
  llama / mistral / qwen2 / qwen3 models with the BPE tokenizer, a llama with the SentencePiece tokenizer,
  Gemma 2 and Gemma 3 (text) with the SentencePiece tokenizer (sliding window 16; Gemma 3 with six layers, so
  that layer 5 attends fully with its own RoPE base), and an NF4 (bitsandbytes, double-quant) prequantized
  copy of the BPE llama; hidden 256 / intermediate 512 so K-quants apply.
- random adapters (non-zero B) for every architecture, saved with PEFT next to their bases;
- two adapters trained with plain PEFT + torch on the CPU to answer one fixed question: on the NF4
  llama (trained on its fp32 dequantized weights, i.e. the QLoRA objective), on the SentencePiece
  llama and on the Gemmas. ``QUESTION``/``ANSWER`` are what they were trained on.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

QUESTION = "What is the secret word of the blue falcon?"
ANSWER = "The secret word is seven bright stones."
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def fp32_model_from_dir(base_dir: Path):
    """A transformers model holding ``base_dir``'s weights in fp32 (4-bit weights dequantized)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from strop.export_svc.core.base_source import BaseModel

    base = BaseModel(base_dir, base_dir.name)
    cfg = {k: v for k, v in base.config.items() if k not in ("quantization_config", "transformers_version")}
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({n: base.read_fp32(n) for n in base.tensors}, strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []  # the embedding table, tied below
    assert missing == tied and unexpected == [], (missing, unexpected)
    if tied:
        model.tie_weights()
    return model


def make_random_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    target_modules: list[str] | None = None,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    use_dora: bool = False,
    seed: int = 0,
) -> Path:
    """A PEFT adapter with random, non-zero A and B (so every merge actually changes the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = fp32_model_from_dir(base_dir)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules or ALL_MODULES,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        use_dora=use_dora,
        lora_dropout=0.0,
    )
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.1 * torch.rand_like(p))
    pm.save_pretrained(out_dir)
    _record_base(out_dir, base_dir)
    return out_dir


def train_adapter(
    base_dir: Path, out_dir: Path, *, steps: int = 120, lr: float = 1e-3, seed: int = 0
) -> Path:
    """Train a rsLoRA adapter (r=8, alpha=16, all seven projections) to answer QUESTION with ANSWER.

    The base's weights are loaded in fp32 (an NF4 base dequantized), which is the function QLoRA
    trains against; the loss is on the answer tokens only, the prompt is the chat template's.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = fp32_model_from_dir(base_dir)
    pm = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=ALL_MODULES, lora_dropout=0.0, use_rslora=True)
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    p_ids = tok(prompt)["input_ids"]
    ids = tok(prompt + ANSWER + "<|im_end|>")["input_ids"]
    x = torch.tensor([ids])
    labels = x.clone()
    labels[0, : len(p_ids)] = -100
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr)
    pm.train()
    for _ in range(steps):
        loss = pm(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    pm.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)  # the trainer's adapters carry the tokenizer files of their base
    _record_base(out_dir, base_dir)
    return out_dir


def _record_base(adapter_dir: Path, base_dir: Path) -> None:
    """As the trainer does: ``base_model_name_or_path`` is the absolute path the base was loaded from."""
    p = adapter_dir / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg["base_model_name_or_path"] = str(base_dir)
    p.write_text(json.dumps(cfg, indent=2))


def build_export_models(root: Path) -> Path:
    """The model root with every tiny base and adapter the export tests use (the root conftest's
    session-scoped ``export_models``, shared by the export service's and the CLI's tests)."""
    import torch

    from strop.fixtures import make_tiny_model, quantize_4bit

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and immune to a busy second core
    try:
        _build(root, make_tiny_model, quantize_4bit)
    finally:
        torch.set_num_threads(threads)
    return root


# transformers' default layer types: Gemma 2 alternates sliding and full; Gemma 3 has five sliding layers, then one
# full (six layers, so that the full-attention layer and its RoPE base are exercised)
GEMMA_LAYERS = {"gemma2": 2, "gemma3_text": 6}
GEMMA_BASES = {"gemma2": "gemma2-spm", "gemma3_text": "gemma3-spm"}


def _build(root: Path, make_tiny_model, quantize_4bit) -> None:
    from strop.fixtures.tiny_models import TinyShape

    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        make_tiny_model(root / f"{arch}-bpe", arch=arch, tokenizer="bpe", seed=1)
    make_tiny_model(root / "llama-spm", arch="llama", tokenizer="spm", seed=2)
    for i, (arch, name) in enumerate(GEMMA_BASES.items()):
        shape = TinyShape(num_layers=GEMMA_LAYERS[arch])
        make_tiny_model(root / name, arch=arch, tokenizer="spm", shape=shape, seed=3 + i)
        make_random_adapter(root / name, root / f"{name}-lora", seed=30 + i)
    quantize_4bit(root / "llama-bpe", root / "llama-bpe-nf4")
    for i, arch in enumerate(("llama", "mistral", "qwen2", "qwen3")):
        make_random_adapter(root / f"{arch}-bpe", root / f"{arch}-bpe-lora", seed=10 + i)
    make_random_adapter(root / "llama-spm", root / "llama-spm-lora", seed=20)
    make_random_adapter(root / "llama-bpe-nf4", root / "llama-bpe-nf4-lora", use_rslora=True, seed=21)
    train_adapter(root / "llama-bpe-nf4", root / "trained-nf4-lora")
    train_adapter(root / "llama-spm", root / "trained-spm-lora")
    train_adapter(root / "gemma2-spm", root / "trained-gemma2-lora")
    train_adapter(root / "gemma3-spm", root / "trained-gemma3-lora")


@pytest.fixture
def store(tmp_path):
    """A fresh, empty artifact store per test."""
    from strop.common.artifacts import ArtifactStore

    return ArtifactStore(tmp_path / "artifacts")


def store_is_empty(store) -> bool:
    """No published artifact and nothing left in the store's scratch area."""
    leftovers = list((store.root / ".tmp").iterdir())
    return not store.list() and not leftovers


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
