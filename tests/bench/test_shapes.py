"""The training bench's model shapes (bench/lib/harness.py): each is the released model it is named after, its
--smoke shape is that architecture in small, and no two shapes share a saved dir.

The sizes are checked against the parameter counts the models' authors publish, which the shapes' dims must
reproduce: a wrong width, layer count or head count moves the count by far more than the published rounding.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from lib.harness import PART_SHAPES, workload  # noqa: E402

# the dims a --smoke shape shrinks; every other config field is the architecture and must be the real shape's
SHRUNK = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "query_pre_attn_scalar",  # Gemma 3 scales scores by head_dim ** -0.5: it follows head_dim
}


def non_embedding_parameters(part: str) -> int:
    """Parameters of the part's real shape outside the token embedding and the LM head (built on the meta device:
    no memory)."""
    config = transformers.AutoConfig.for_model(**workload(part, smoke=False).model_config())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embed = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embed)


@pytest.mark.parametrize(
    ("part", "published", "rounding"),
    [
        # Qwen/Qwen3-8B's model card: "Number of Parameters (Non-Embedding): 6.95B"
        ("qlora-qwen3-8b", 6.95e9, 0.005e9),
        # Gemma 3 technical report, table 1: non-embedding parameters 3,209M (4B), 698M (1B)
        ("qlora-gemma3-4b", 3209e6, 0.5e6),
        ("gemma", 698e6, 0.5e6),
    ],
)
def test_shape_has_the_released_models_parameter_count(part, published, rounding):
    count = non_embedding_parameters(part)
    assert abs(count - published) <= rounding, (
        f"{part}: {count:,} non-embedding parameters, published {published:,.0f}"
    )


def test_qwen3_shape_normalizes_q_and_k_and_unties_the_head():
    config = transformers.AutoConfig.for_model(**workload("qlora-qwen3-8b", smoke=False).model_config())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (128,) and attn.k_norm.weight.shape == (128,), "per-head q/k RMSNorm"
    assert model.lm_head.weight is not model.model.embed_tokens.weight, "Qwen3-8B's head is its own matrix"


def test_gemma3_4b_shape_alternates_five_sliding_layers_with_one_full():
    config = transformers.AutoConfig.for_model(**workload("qlora-gemma3-4b", smoke=False).model_config())
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29], "every sixth of the 34 layers attends to the whole sequence"
    assert config.sliding_window == 1024 and config.tie_word_embeddings
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"


@pytest.mark.parametrize("part", sorted(PART_SHAPES))
def test_smoke_shape_is_the_same_architecture(part):
    real = workload(part, smoke=False).model_config()
    small = workload(part, smoke=True).model_config()
    assert real.keys() == small.keys()
    differs = {k for k in real if real[k] != small[k]}
    assert differs <= SHRUNK, f"--smoke changes more than the dims: {sorted(differs - SHRUNK)}"
    real_shape, small_shape = PART_SHAPES[part]
    assert (small_shape["kv_heads"] < small_shape["heads"]) == (real_shape["kv_heads"] < real_shape["heads"])
    assert (small_shape["kv_heads"] == 1) == (real_shape["kv_heads"] == 1), "multi-query stays multi-query"


@pytest.mark.parametrize("smoke", [False, True])
def test_each_shape_has_its_own_saved_dir(smoke):
    parts = ["qlora", *PART_SHAPES]
    configs: dict[str, dict] = {}
    for part in parts:
        w = workload(part, smoke)
        config = configs.setdefault(w.saved_model_dir(), w.model_config())
        assert config == w.model_config(), f"{part} would overwrite another shape's saved model"
    assert len(configs) == 5, "llama-8b, gemma3-1b, llama-1b, qwen3-8b, gemma3-4b"
