"""The architecture registry (``strop.common.archs``) states what transformers actually builds."""

from __future__ import annotations

import pytest

from strop.common.archs import ARCHS, MODEL_TYPES, SlidingWindow, expected_tensors


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize(("attention_bias", "mlp_bias"), [(False, False), (True, True)])
def test_the_registry_matches_the_model_transformers_builds(model_type, attention_bias, mlp_bias):
    import torch
    import transformers

    arch = ARCHS[model_type]
    config = getattr(transformers, arch.hf_config_class)(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
    )
    assert config.model_type == model_type
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == arch.hf_class
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert expected_tensors(config.to_dict()) == built, (
        f"{model_type} (attention_bias={attention_bias}, mlp_bias={mlp_bias}): the biases, norms and "
        "shapes the registry implies are not the ones transformers creates"
    )
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") == arch.qk_norm
    assert hasattr(attn, "sliding_window") == (arch.sliding_window is SlidingWindow.LAYER)
