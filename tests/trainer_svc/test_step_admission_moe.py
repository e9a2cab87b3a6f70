"""A step-API ForwardBackward on a mixture of experts is admitted as a Train job's step is
(``runs.forward_backward_estimate`` → ``admission.estimate``): on HF's expert path a layer's whole stack,
E · 3 · I · H 16-bit values, is saved for backward when a run puts LoRA on the experts (PEFT's ``W + s·BA``) or
the session holds them in NF4 (dequantized for the call); an attention-only run on a 16-bit session saves none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from strop.common.step_types import Datum, RunLora, TrainingRunInfo
from strop.common.trainer_types import LoadModelRequest, Quantization


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model

    root = tmp_path_factory.mktemp("moe-step-admission")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", shape=shape, dtype="float32", vocab_size=320)
    return root


@pytest.mark.parametrize("train_mlp", [True, False], ids=["expert-lora", "attention-lora"])
@pytest.mark.parametrize("quantization", [Quantization.NF4, Quantization.NONE], ids=["nf4", "16-bit"])
def test_a_forward_backward_on_an_moe_counts_the_expert_stacks_hf_saves(moe_root, quantization, train_mlp):
    from strop.common.archs import moe_sizes
    from strop.common.trainer_types import TrainConfig, TrainMethod
    from strop.trainer_svc.core import admission, step_ops
    from strop.trainer_svc.core.model_loading import load_model
    from strop.trainer_svc.core.runs import forward_backward_estimate

    req = LoadModelRequest(model_path="qwen3_moe", quantization=quantization, dtype="float32")
    loaded = load_model(req, model_root=moe_root, device="cpu")
    assert not loaded.facts.kernels_enabled, (
        "no CUDA: HF's expert path, which is what saves the dequantized stacks"
    )
    targets = step_ops.add_adapter(
        loaded, "run-a", RunLora(rank=4, train_mlp=train_mlp, seed=0), trainable=True
    )
    assert ("down_proj" in targets) == train_mlp, "train_mlp is LoRA on the experts"
    data = [Datum.of(list(range(1, 25))), Datum.of(list(range(1, 17)))]

    est = forward_backward_estimate(loaded, TrainingRunInfo(target_modules=targets), data)

    config = loaded.model.get_base_model().config
    unquantized = admission.estimate(
        config,
        TrainConfig(method=TrainMethod.SFT, batch_size=2, max_length=24),
        longest_row=24,
        n_trainable=0,
        checkpointed=True,
        offloaded=False,
        kernels=False,
    )
    n_exp, _, inter_e = moe_sizes(config)
    # checkpointed: the merged (expert LoRA) or dequantized (NF4) stack is saved by the two layers live at once (the
    # one recomputed, the one whose backward runs: admission's 2 · (one_layer + stack)); NF4: the copy HF holds for
    # the call once more
    one_stack = n_exp * 3 * inter_e * config.hidden_size * 2
    nf4 = quantization is Quantization.NF4
    extra = (3 if nf4 else 2 if train_mlp else 0) * one_stack
    assert est.tokens == 2 * 24 and est.logits == unquantized.logits
    assert est.layers - unquantized.layers == extra, (est, unquantized, one_stack)
