"""Admission by device memory: before its first step, a job's peak is estimated from the model's shape, its
longest batch and what its memory mode installed; a job that cannot fit in the device memory free for it
ends FAILED with RESOURCE_EXHAUSTED and the figures, instead of running out of memory mid-run.

The estimate, per training step, beside the weights the session already holds (bf16 activations, itemsize 2;
T = rows × the longest tokenized row, capped at max_length; H hidden, I intermediate, KV = key/value width):

    adapter state      12 · n_trainable                  fp32 gradient + Adam's two moments (8-bit Adam: 6)
                       4 · n_trainable + 2 chunk buffers  Adam's moments in host memory (HostAdamW): the gradient
                                                         and the two buffers the moments stream through
    one layer          T · (a·H + b·KV + c·I)            what a decoder layer saves for backward, in bytes per
                                                         token: HF's layer (a, b, c = 40, 8, 8: its RMSNorms keep
                                                         fp32 copies, q/k and their rotations, the MLP's gate, up,
                                                         activation and product), strop's fused kernels
                                                         (12, 4, 4: the inputs, q/k/v, the attention output,
                                                         the MLP's gate and up); Gemma's two extra RMSNorms per
                                                         layer add 16 to a on HF's path (each keeps fp32 x and
                                                         x̂) and 4 on the kernels' (each keeps its bf16 input)
                                                         Mixture of experts (E experts, k per token, expert
                                                         size I_e): the MLP term c·I becomes k·(8·H + 10·I_e)
                                                         + 10·E (HF's expert loop: each routed copy of the input,
                                                         gate/up, the activation and product, the weighted output;
                                                         the router's logits and fp32 probabilities)
    expert stacks      E · 3·I_e·H · 2 per layer kept    LoRA on fused experts on HF's path (PEFT's ParamWrapper):
                                                         each forward builds W + s·BA for the whole stack and the
                                                         expert GEMMs save it for backward; counted for every layer
                                                         kept (checkpointed: 2); none on strop's grouped expert GEMM.
                                                         NF4 experts on HF's path: the same per layer kept (the
                                                         dequantized stack the expert GEMMs save), plus one layer's
                                                         stack dequantized for the call; on the grouped GEMM
                                                         only the scratch buffer the merged stacks are written
                                                         into: gate/up's slot and down's, E · 3·I_e·H · 2 (16-bit
                                                         experts too)
    layers kept        L · one layer                     without checkpointing
                       L · T·H·2 + 2 · one layer         checkpointed: every layer input, one layer recomputed
                                                         and its backward's transients
                       2 · T·H·2 + 2 · one layer         inputs offloaded to the host: two on the device
    logits             T · V · 10                        HF: bf16 logits, their fp32 copy and its gradient
                                                         (+ 2: Gemma's soft-cap keeps tanh's bf16 output)
                       3 · 256 MiB + 4 · T·H             strop's fused linear + cross-entropy: one chunk of
                                                         logits and its temporaries, the hidden states' gradient

Checked two ways: against what a real forward saves (tests/trainer_svc/test_admission.py counts every tensor
autograd keeps: the estimate is above it and within 2x), and against the H200's measured peak of 8B QLoRA at
8 x 2048 tokens with no layer recomputed (issue 15: 60.8 GiB with ~5.6 GiB of weights; the estimate's layers and
logits: 55.0 GiB) and in the standard mode (9.0 GiB: 3.4 GiB beside the weights; estimated 5.1 GiB). It leaves out the allocator's fragmentation, so only a job whose estimate exceeds the free
memory is refused: one that might fit is let run.

A job whose AdamW (``adamw_torch``, ``adamw_torch_fused``) does not fit with its moments on the device but fits with
them in host memory is admitted that way (``admit``'s second estimate): the trainer then updates with
``kernels/models/host_adamw.HostAdamW``, torch's AdamW bit for bit with the moments streamed through the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from strop.common.archs import arch_of, moe_sizes
from strop.common.errors import ResourceExhausted
from strop.common.memory_modes import MemoryFeatures
from strop.common.trainer_types import TrainConfig, TrainMethod

log = logging.getLogger("strop.trainer.admission")


@dataclass
class Estimate:
    tokens: int
    adapter_state: int
    layers: int
    logits: int

    @property
    def total(self) -> int:
        return self.adapter_state + self.layers + self.logits

    def __str__(self) -> str:
        g = 2**30
        return (
            f"≈{self.total / g:.2f} GiB for {self.tokens} tokens per step (adapter state {self.adapter_state / g:.2f}, "
            f"layer activations {self.layers / g:.2f}, logits {self.logits / g:.2f})"
        )


def estimate(
    hf_config,
    cfg: TrainConfig,
    *,
    longest_row: int,
    n_trainable: int,
    checkpointed: bool,
    offloaded: bool,
    kernels: bool,
    expert_lora: bool = False,
    nf4_experts: bool = False,
    host_adam_moments: bool = False,
    kl_tokens: int = 0,
    kl_cached_tokens: int = 0,
) -> Estimate:
    """The estimate of the module docstring for one step of ``cfg`` on a model of ``hf_config`` (``expert_lora``: a
    mixture of experts whose experts carry LoRA; ``nf4_experts``: whose experts are held in NF4;
    ``host_adam_moments``: AdamW's moments held in host memory, :class:`HostAdamW`; ``kl_tokens``: the positions of
    retention's KL batch, whose forward and backward run in the same step as the rows'; ``kl_cached_tokens``: the
    scored positions whose base hidden states the KL term keeps, fp32 at most)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    h, inter = int(text.hidden_size), int(text.intermediate_size)
    n_layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim
    # preference methods: chosen and rejected (KTO: each row and its KL row, a mismatched completion)
    rows = cfg.batch_size * (1 if cfg.method is TrainMethod.SFT else 2)
    t = rows * min(longest_row, cfg.max_length) + kl_tokens
    a, b, c = (12, 4, 4) if kernels else (40, 8, 8)
    model_type = str(getattr(text, "model_type", ""))
    arch = arch_of(model_type)
    if arch is not None and arch.sandwich_norms:
        a += 4 if kernels else 16
    stack = dequantized = 0
    if arch is not None and arch.moe is not None:  # the experts run HF's path either way
        n_exp, top_k, inter_e = moe_sizes(text)
        one_layer = t * (a * h + b * kv + top_k * (8 * h + 10 * inter_e) + 10 * n_exp)
        # HF's expert path under PEFT merges W + s·BA for the whole stack (NF4 experts: it saves the stack
        # dequantized for the call); the grouped expert GEMM saves none, and merges each stack (16-bit or NF4
        # experts) into nf4's shared scratch buffer, gate_up (E·2·I_e·H) into its first slot and down (E·I_e·H) into
        # its second, both kept between calls
        stack = n_exp * 3 * inter_e * h * 2 if (expert_lora or nf4_experts) and not kernels else 0
        # the grouped GEMM's two slots (without expert LoRA the experts run HF's path), or HF's NF4 stack
        dequantized = n_exp * 3 * inter_e * h * 2 if (kernels and expert_lora) or nf4_experts else 0
    else:
        one_layer = t * (a * h + b * kv + c * inter)
    if not checkpointed:
        layers = n_layers * (one_layer + stack)
    elif offloaded:
        layers = 2 * t * h * 2 + 2 * (one_layer + stack)
    else:
        layers = n_layers * t * h * 2 + 2 * (one_layer + stack)
    if kernels:
        from strop.kernels.ops.fused_linear_ce import _CHUNK_LOGITS_BYTES

        logits = 3 * _CHUNK_LOGITS_BYTES + 4 * t * h
    else:
        softcapped = getattr(text, "final_logit_softcapping", None) is not None
        logits = t * vocab * (12 if softcapped else 10)
    if host_adam_moments:
        from strop.kernels.models.host_adamw import host_adamw_device_bytes

        adapter_state = 4 * n_trainable + host_adamw_device_bytes()
    else:
        adapter_state = (6 if "8bit" in cfg.optimizer else 12) * n_trainable
    return Estimate(t, adapter_state, layers + dequantized + 4 * h * kl_cached_tokens, logits)


def longest_row(dataset) -> int:
    """Tokens in the longest tokenized row of a TRL-prepared dataset (SFT input_ids; preference: prompt + the
    longer answer; KTO: prompt + completion); 0 when it holds no token ids."""
    cols = set(getattr(dataset, "column_names", None) or [])
    if "input_ids" in cols:
        return max((len(x) for x in dataset["input_ids"]), default=0)
    if "prompt_ids" in cols or "prompt_input_ids" in cols:
        p = "prompt_ids" if "prompt_ids" in cols else "prompt_input_ids"
        answers = [
            c
            for c in (
                "chosen_ids",
                "rejected_ids",
                "chosen_input_ids",
                "rejected_input_ids",
                "completion_ids",
            )
            if c in cols
        ]
        lengths = zip(*(dataset[c] for c in [p, *answers]), strict=True)
        return max((len(r[0]) + max(len(a) for a in r[1:]) for r in lengths), default=0)
    return 0


# the optimizers HostAdamW reproduces bit for bit (torch's AdamW, grouped or fused kernels)
HOST_MOMENT_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def host_has_room_for_moments(
    n_trainable: int, available: int | None, memory: MemoryFeatures | None = None
) -> bool:
    """Whether ``available`` bytes of host memory (None: unknown, assumed enough) hold AdamW's two fp32 moments in
    pinned memory, counted twice over (the pinned allocator rounds each chunk's block up to a power of two), beside
    the share the job's memory mode ``memory`` may give its offloaded activations (its host budget; half the host
    where offload needs room)."""
    if available is None:
        return True
    share = 0.0
    if memory is not None and memory.offload_layer_inputs:
        share = memory.host_budget_fraction or (0.5 if memory.offload_needs_host_room else 0.0)
    return available * (1 - share) >= 2 * 8 * n_trainable


def admit(est: Estimate, free_bytes: int, host_moments: Estimate | None = None) -> bool:
    """Refuse a job whose estimate exceeds the device memory free for it (ResourceExhausted, with the figures).

    ``host_moments``: the same job's estimate with AdamW's moments in host memory, for a job whose optimizer
    HostAdamW reproduces. Returns True when only that one fits (the trainer must hold the moments on the host)."""
    log.info("memory estimate %s; %.2f GiB free", est, free_bytes / 2**30)
    if est.total > free_bytes and host_moments is not None and host_moments.total <= free_bytes:
        log.info("admitted with AdamW's moments in host memory: %s", host_moments)
        return True
    if est.total > free_bytes:
        raise ResourceExhausted(
            f"this job needs {est} but the device has {free_bytes / 2**30:.2f} GiB free beside the session's "
            "weights: lower batch_size or max_length, or use memory_mode LONG_CONTEXT"
            + (f" (with AdamW's moments in host memory: {host_moments})" if host_moments is not None else "")
        )
    return False


def hold_adam_moments_on_host(trainer) -> None:
    """Make a transformers Trainer whose optimizer is torch's AdamW create it as HostAdamW (same parameter groups
    and arguments: the same updates bit for bit) when it builds its optimizer."""
    import torch

    from strop.kernels.models.host_adamw import HostAdamW

    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    if cls is not torch.optim.AdamW:
        raise ValueError(f"moments in host memory need torch's AdamW, not {cls.__name__}")
    trainer.optimizer_cls_and_kwargs = (HostAdamW, kwargs)
