"""Loading base models and attaching LoRA and the kernels (torch, transformers, PEFT). Generating from a loaded
model is ``generation.py``'s, the files a saved adapter holds ``adapter_files.py``'s; their names are importable
from here too (``model_loading.generate``, ``model_loading.write_adapter``…), as the trainer's modules call them.

A prequantized bitsandbytes 4-bit checkpoint is detected from its config and loaded as is; a 16-bit
checkpoint is quantized to NF4 with double quant on load, or kept 16-bit for plain LoRA. Only
safetensors are read and remote code is never run.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from strop.common import hf_build
from strop.common.archs import KERNEL_MODEL_TYPES, arch_of
from strop.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from strop.common.paths import confine, confine_files
from strop.common.trainer_types import (
    DEFAULT_TARGET_MODULES,
    FP8_KERNEL_MODES,
    KernelMode,
    LoadModelRequest,
    LoraConfig,
    ModelFacts,
    Quantization,
)
from strop.trainer_svc.core import moe
from strop.trainer_svc.core.adapter_files import (  # noqa: F401  (model_loading.X is how the trainer's modules call them)
    NF4_STATS_FILE,
    adapter_metadata,
    base_quant_metadata,
    copy_tokenizer_files,
    loaded_base_quant,
    quant_state_of,
    write_adapter,
    write_base_record,
    write_nf4_stats,
)
from strop.trainer_svc.core.generation import (  # noqa: F401  (as above)
    INFERENCE_COPY,
    INFERENCE_COPY_HOST_SHARE,
    MAX_GENERATE_TOKENS,
    drop_inference_weights,
    generate,
    generate_chat,
    generate_chat_batch,
    inference_weights,
)
from strop.trainer_svc.core.loaded_model import LoadedModel

log = logging.getLogger("strop.trainer")

KERNEL_ARCHS = frozenset(KERNEL_MODEL_TYPES)  # what the kernels patch (strop.common.archs)
DTYPES = ("bfloat16", "float16", "float32")


def pick_device(requested: str = "auto") -> str:
    import torch

    if requested and requested != "auto":
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _memory_in_use(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise InvalidArgument(f"{model_dir.name!r} is not a Hugging Face model directory (no config.json)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{model_dir.name}/config.json is not valid JSON: {exc}") from None


def detect_quantization(config: dict) -> str:
    q = config.get("quantization_config") or {}
    if q.get("quant_method") == "bitsandbytes" and q.get("load_in_4bit"):
        return "bnb-4bit"
    if q:
        return str(q.get("quant_method", "unknown"))
    return "none"


def load_model(
    req: LoadModelRequest,
    *,
    model_root: Path,
    device: str,
    load_device: str | None = None,
) -> LoadedModel:
    """Load ``req.model_path`` (confined under ``model_root``) for ``device``.

    The weights are placed on ``load_device`` (default: ``device``); everything else (dtype defaults, kernels,
    the session's device) follows ``device``. A rank of a sharded job loads into host memory this way and FSDP2
    moves each layer to ``device`` as it shards it (``fsdp.staging_device``). A 4-bit Qwen3-MoE / Mixtral holds
    its experts in strop's NF4 storage (``moe.hold_experts_in_nf4``), on every rank of a job on ranks too (FSDP2
    shards it: ``fsdp.shard_nf4_experts``).

    Raises:
        InvalidArgument: path outside the root, not a model dir, only pickle weights, bad dtype, or a
            quantization request that contradicts the checkpoint.
        NotFound: nothing at the path.
        ResourceExhausted: the device ran out of memory while loading.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    model_dir = confine(model_root, req.model_path, what="model path")
    if not model_dir.is_dir():
        raise InvalidArgument(f"model path {req.model_path!r} is not a directory")
    confine_files(model_root, model_dir, what=f"model {req.model_path!r}")
    config = read_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise InvalidArgument(
                f"model {req.model_path!r} has only pickle weights; strop loads safetensors only"
            )
        raise InvalidArgument(f"model {req.model_path!r} has no .safetensors weights")
    dtype_name = req.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype_name not in DTYPES:
        raise InvalidArgument(f"dtype {req.dtype!r} is not one of {DTYPES}")
    dtype = getattr(torch, dtype_name)
    existing = detect_quantization(config)
    if existing not in ("none", "bnb-4bit"):
        raise InvalidArgument(
            f"model {req.model_path!r} is quantized with {existing!r}; strop loads bnb-4bit or 16-bit"
        )
    if existing == "bnb-4bit" and req.quantization is Quantization.NONE:
        raise InvalidArgument(
            f"model {req.model_path!r} is a prequantized 4-bit checkpoint; it cannot be loaded as 16-bit "
            "(use quantization NF4 or unspecified)"
        )
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FailedPrecondition(f"device {device} requested but CUDA is not available")
    if req.kernels in FP8_KERNEL_MODES:
        check_fp8(device, dtype_name, req.kernels)

    kwargs: dict[str, Any] = dict(
        dtype=dtype, device_map={"": load_device or device}, trust_remote_code=False, use_safetensors=True
    )
    if existing == "bnb-4bit":
        quant_label = "bnb-nf4-prequantized"
        qc = config["quantization_config"]
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=qc.get("bnb_4bit_quant_type", "nf4"),
            bnb_4bit_use_double_quant=qc.get("bnb_4bit_use_double_quant", True),
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=getattr(torch, qc.get("bnb_4bit_quant_storage", "uint8")),
        )
    elif req.quantization is Quantization.NONE:
        quant_label = "none"
    else:
        quant_label = "bnb-nf4-on-load"
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )

    before = _memory_in_use(device)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        # sessions load on gRPC threads: one build at a time (common/hf_build); a 4-bit MoE's experts go NF4 as
        # each stack loads
        with hf_build.building(), moe.experts_in_nf4_while_loading(hf_config, quant_label, dtype):
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except torch.OutOfMemoryError as exc:
        gc.collect()
        torch.cuda.empty_cache()
        raise ResourceExhausted(f"out of device memory loading {req.model_path!r}: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidArgument(f"cannot load model {req.model_path!r}: {exc}") from None
    hf_build.check_built(model, f"model {req.model_path!r}")
    model.config.use_cache = False
    keep_4bit_layers_trainable(model)
    if existing == "bnb-4bit":
        compute_prequantized_in(model, dtype)
    moe.hold_experts_in_nf4(model, hf_config, quant_label)  # any expert stack the load did not set: NF4 too
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    max_len = req.max_seq_length or max_pos or 2048
    if max_pos and req.max_seq_length > max_pos:
        raise InvalidArgument(f"max_seq_length {req.max_seq_length} exceeds the model's {max_pos} positions")
    facts = ModelFacts(
        model_path=str(model_dir.relative_to(model_root.resolve())),
        architecture=(hf_config.architectures or [type(model).__name__])[0],
        model_type=hf_config.model_type,
        num_parameters=count_parameters(model),
        num_trainable_parameters=0,
        quantization=quant_label,
        compute_dtype=dtype_name,
        device=device,
        device_memory_bytes=max(0, _memory_in_use(device) - before),
        max_seq_length=max_len,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        num_layers=int(hf_config.num_hidden_layers),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    facts.kernels_enabled, facts.kernels_reason = decide_kernels(req.kernels, device, hf_config.model_type)
    if note := moe.expert_note(model, hf_config):
        facts.kernels_reason += f"; {note}"
    loaded = LoadedModel(model, tokenizer, facts, model_dir, facts.model_path, device)
    if facts.kernels_enabled and req.kernels in FP8_KERNEL_MODES:
        loaded.fp8_kernels = req.kernels
    return loaded


def keep_4bit_layers_trainable(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout; returns the layer count.

    bitsandbytes >= 0.49 on a CPU with AVX512-BF16 repacks a ``Linear4bit`` weight the first time the layer
    runs in eval mode without grad (Generate does): absmax is cast to bf16, ``quant_state`` gains
    ``packing_format_for_cpu``, and every later CPU matmul goes to ``gemv_4bit``, which has no backward, so a
    training step after a Generate gets no gradient through the frozen 4-bit layers. ``train()`` does not undo
    it and the inverse re-quantizes absmax (lossy), so the repack is switched off per layer instead: the
    flag it checks is an instance attribute set in ``Linear4bit.__init__`` from ``has_avx512bf16()``.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def compute_prequantized_in(model, dtype) -> int:
    """Make a prequantized 4-bit model compute in ``dtype``, the session's compute dtype; returns how many
    16-bit tensors were cast.

    transformers loads a prequantized bitsandbytes checkpoint's other weights (embeddings, norms, the head) in
    the dtype they were saved in and keeps its ``Linear4bit`` layers on the saved ``bnb_4bit_compute_dtype``,
    whatever ``dtype`` (and the BitsAndBytesConfig) asks (transformers 5.17; its issue #47378). A bf16 checkpoint
    loaded "in float32" then runs bf16 activations throughout while the session reports float32. The 4-bit codes
    and their scales are left as they are; buffers too (RoPE's inv_freq is fp32 by design).
    """
    from bitsandbytes.nn import Linear4bit, Params4bit

    for mod in model.modules():
        if isinstance(mod, Linear4bit):
            mod.compute_dtype, mod.compute_type_is_set = dtype, True
    cast = 0
    for p in model.parameters():
        if not isinstance(p, Params4bit) and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def repacked_4bit_layers(model) -> list[str]:
    """Names of 4-bit layers whose weight is in bitsandbytes' CPU inference layout (which has no backward)."""
    names = []
    for name, module in model.named_modules():
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(quant_state, "packing_format_for_cpu", False):
            names.append(name)
    return names


def check_fp8(device: str, dtype_name: str, mode: KernelMode) -> None:
    """Refuse an FP8 kernel mode (ON_FP8, ON_FP8_DX) where its GEMMs cannot run: they need bf16 compute (the scaled
    GEMM's output dtype) and a CUDA GPU with e4m3 tensor cores (the Triton interpreter's CPU run is for tests).

    Raises:
        InvalidArgument: a compute dtype other than bfloat16.
        FailedPrecondition: a GPU without FP8 tensor cores, or a CPU without TRITON_INTERPRET=1.
    """
    import torch

    if dtype_name != "bfloat16":
        raise InvalidArgument(
            f"kernels {mode} needs dtype 'bfloat16' (the FP8 GEMMs' output dtype), got {dtype_name!r}"
        )
    from strop.kernels.ops.fp8 import fp8_device_reason

    if device.startswith("cuda"):
        reason = fp8_device_reason(torch.device(device))
        if reason:
            raise FailedPrecondition(f"kernels {mode}: {reason}")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise FailedPrecondition(f"kernels {mode} need a CUDA device (or TRITON_INTERPRET=1 for testing)")


def decide_kernels(mode: KernelMode, device: str, model_type: str) -> tuple[bool, str]:
    """Whether strop's Triton kernels will be patched in, and why (shown in the session's facts)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if mode is KernelMode.OFF:
        return False, "kernels off by request: unpatched HF + PEFT"
    fp8 = {
        KernelMode.ON_FP8: " with FP8 base GEMMs (opt-in, inexact)",
        KernelMode.ON_FP8_DX: " with FP8 dx GEMMs (opt-in, inexact; forward exact)",
    }.get(mode, "")
    if mode in FP8_KERNEL_MODES:
        mode = KernelMode.ON  # from here on, what ON requires
    if model_type not in KERNEL_ARCHS:
        why = getattr(arch_of(model_type), "no_kernels", "")
        if mode is KernelMode.ON:
            raise InvalidArgument(
                why or f"kernels requested but arch {model_type!r} has no fast path ({sorted(KERNEL_ARCHS)})"
            )
        return False, f"arch {model_type!r} has no fast path: unpatched HF + PEFT"
    if not device.startswith("cuda"):
        if mode is KernelMode.ON and interpreted:
            return True, f"kernels on by request{fp8}, run by the Triton interpreter (TRITON_INTERPRET=1)"
        if mode is KernelMode.ON:
            raise FailedPrecondition("kernels need a CUDA device (or TRITON_INTERPRET=1 for testing)")
        return False, "no CUDA device: unpatched HF + PEFT"
    return True, f"CUDA device: strop Triton kernels{fp8}"


def count_parameters(model) -> int:
    """Logical parameter count (a packed 4-bit tensor holds two parameters per byte)."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if p.dtype.is_floating_point is False and hasattr(p, "quant_state"):
            n *= 2
        total += n
    return total


def linear_module_names(model) -> set[str]:
    """Leaf names of the model's linear layers (16-bit or bnb 4-bit), excluding the LM head."""
    import torch

    names = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head":
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(leaf)
    return names


def validate_lora(cfg: LoraConfig, model) -> LoraConfig:
    if cfg.r <= 0:
        raise InvalidArgument(f"LoRA rank r must be positive, got {cfg.r}")
    if cfg.r > 1024:
        raise InvalidArgument(f"LoRA rank r={cfg.r} is above the limit of 1024")
    if not (math.isfinite(cfg.alpha) and cfg.alpha > 0):
        raise InvalidArgument(f"LoRA alpha must be a positive finite number, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:  # NaN fails this too
        raise InvalidArgument(f"LoRA dropout must be in [0, 1), got {cfg.dropout}")
    targets = list(cfg.target_modules) or list(DEFAULT_TARGET_MODULES)
    available = linear_module_names(model)
    # mixtures of experts: expert projections are fused parameters (trainer_svc/core/moe.py validates them)
    moe.peft_targets(model.config, targets, available, dropout=cfg.dropout, train_router=cfg.train_router)
    unknown = sorted(
        set(targets) - available - (set(moe.EXPERT_TARGETS) if moe.moe_arch(model.config) else set())
    )
    if unknown:
        raise InvalidArgument(f"unknown target module(s) {unknown}; this model has {sorted(available)}")
    return LoraConfig(cfg.r, cfg.alpha, cfg.dropout, targets, cfg.use_rslora, cfg.seed, cfg.train_router)


def attach_lora(loaded: LoadedModel, cfg: LoraConfig) -> None:
    """Wrap the model with a PEFT LoRA adapter (weights fp32) and, on the fast path, patch the kernels."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from strop.kernels.models.hf import keep_trainable_fp32

    if loaded.lora is not None:
        raise FailedPrecondition("this session already has a LoRA adapter")
    cfg = validate_lora(cfg, loaded.model)
    torch.manual_seed(cfg.seed)
    targets = moe.peft_targets(
        loaded.model.config,
        list(cfg.target_modules),
        linear_module_names(loaded.model),
        dropout=cfg.dropout,
        train_router=cfg.train_router,
    )
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets.target_modules,
        target_parameters=targets.target_parameters or None,
        modules_to_save=targets.modules_to_save or None,
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # autocast_adapter_dtype keeps LoRA weights (and so optimizer state) in fp32 over a 16/4-bit base.
    model = get_peft_model(loaded.model, peft_cfg, autocast_adapter_dtype=True)
    keep_trainable_fp32(model)
    loaded.model = model
    if loaded.facts.kernels_enabled:
        try:
            loaded.kernel_report = apply_kernels(loaded)
        except BaseException as exc:
            from strop.kernels.models import unpatch_model

            unpatch_model(model)  # drops any FP8 copies made
            loaded.model = model.unload()  # the session stays as it was: no adapter
            if isinstance(exc, torch.OutOfMemoryError):  # only the FP8 copies allocate device memory there
                torch.cuda.empty_cache()
                raise ResourceExhausted(
                    f"the FP8 copies of the base weights do not fit on {loaded.device}: {exc}"
                ) from None
            raise
    loaded.lora = cfg
    loaded.facts.num_trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_kernels(loaded: LoadedModel):
    """Patch strop's kernels into the PEFT model; the report's summary goes into the session facts. Patching again
    (a step-API run's adapter wrapped layers an earlier patch did not cover) replaces the earlier patch, its FP8
    copies and its summary."""
    from strop.kernels.models import patch_model

    # the device it trains on, wherever it is held now
    fp8_base = FP8_KERNEL_MODES.get(loaded.fp8_kernels, False)
    previous = loaded.kernel_report
    report = patch_model(loaded.model, device=loaded.device, fp8_base=fp8_base)
    loaded.facts.device_memory_bytes += report.fp8_bytes - (previous.fp8_bytes if previous is not None else 0)
    text = ", ".join(f"{component} {state}" for component, state in report.summary().items())
    text += "".join(f"; {note}" for note in report.notes if note.startswith("FP8"))
    before = loaded.extra.setdefault("kernels_reason_unpatched", loaded.facts.kernels_reason)
    loaded.facts.kernels_reason = f"{before}; {text}"
    return report


def release(loaded: LoadedModel) -> None:
    """Drop the model and return its device memory."""
    import torch

    drop_inference_weights(loaded)
    loaded.model = None
    loaded.tokenizer = None
    gc.collect()
    if loaded.device.startswith("cuda"):
        torch.cuda.empty_cache()
