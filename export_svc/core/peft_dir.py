"""A PEFT adapter directory that vLLM's ``--enable-lora`` accepts, and the checks its PEFT helper makes.

vLLM (``vllm/lora/peft_helper.py``, ``vllm/config/lora.py``, ``vllm/lora/utils.py``) requires
``r``, ``lora_alpha`` and ``target_modules`` in ``adapter_config.json``; refuses DoRA, any ``bias``
other than ``"none"``, ``modules_to_save``, LoRA biases; needs ``r <= --max-lora-rank`` (one of
1, 8, 16, 32, 64, 128, 256, 320, 512); honours ``use_rslora`` (scale ``alpha/sqrt(r)``); and takes
only tensors named ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` (embeddings:
``lora_embedding_A`` / ``lora_embedding_B``) on modules its model class supports.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from strop.common.adapter_base import TOKENIZER_FILES
from strop.export_svc.core import moe
from strop.export_svc.core.adapter_source import Adapter
from strop.export_svc.core.base_source import BaseModel, read_json
from strop.export_svc.core.errors import TargetRefused
from strop.export_svc.core.st_io import SafetensorsFile

LORA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What vLLM's LoRA loader accepts for these models: the seven projections, plus the embedding modules
# its Llama/Qwen model classes declare (`embedding_modules`).
VLLM_LORA_MODULES = frozenset({*LORA_LINEAR_MODULES, "embed_tokens", "lm_head"})
# vLLM's Gemma2ForCausalLM / Gemma3ForCausalLM declare no `embedding_modules` (only the packed qkv_proj and
# gate_up_proj): LoRA on their embeddings or lm_head is not served.
_NO_EMBEDDING_LORA = frozenset({"gemma2", "gemma3_text"})


def vllm_lora_modules(model_type: str | None = None) -> frozenset[str]:
    """The module leaf names vLLM's LoRA loader accepts for ``model_type`` (None: the Llama family's)."""
    return frozenset(LORA_LINEAR_MODULES) if model_type in _NO_EMBEDDING_LORA else VLLM_LORA_MODULES


# vLLM's `--max-lora-rank` choices (vllm/config/lora.py, MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_REFUSED_INIT = ("pissa", "olora", "loftq", "corda", "eva")


def vllm_max_lora_rank(r: int) -> int | None:
    """The smallest ``--max-lora-rank`` value vLLM accepts that admits rank ``r`` (None: too large)."""
    for v in VLLM_MAX_LORA_RANKS:
        if r <= v:
            return v
    return None


def refusals(adapter: Adapter, model_type: str | None = None) -> list[str]:
    """Why this adapter cannot be served by vLLM's LoRA loader as it is (empty: it can).

    ``model_type``: the base's (``config.model_type``); the modules vLLM accepts depend on it.
    """
    out = []
    if adapter.use_dora:
        out.append("it uses DoRA, which vLLM does not support (export a merged model instead)")
    if adapter.replacements:
        out.append(
            f"it saves whole modules ({sorted(adapter.replacements)[:3]}), and vLLM only accepts modules_to_save=None"
        )
    if adapter.config.get("bias", "none") != "none":
        out.append(f"bias={adapter.config.get('bias')!r}; vLLM only supports bias='none'")
    unknown = sorted(
        {m.module.rsplit(".", 1)[-1] for m in adapter.modules.values() if m.a_rows is None}
        - vllm_lora_modules(model_type)
    )
    if unknown:
        out.append(
            f"it adapts modules vLLM's {model_type or 'Llama-family'} classes do not support: {unknown}"
        )
    r_max = max((m.r for m in adapter.modules.values()), default=0)
    if vllm_max_lora_rank(r_max) is None:
        out.append(f"rank {r_max} exceeds vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}")
    init = str(adapter.config.get("init_lora_weights", True)).lower()
    if any(init.startswith(x) for x in _REFUSED_INIT):
        out.append(f"init_lora_weights={init!r} changes the base weights; vLLM cannot serve it")
    if adapter.config.get("layer_replication"):
        out.append("layer_replication is set; vLLM cannot serve it")
    return out


# A Hugging Face hub id: "owner/name" (no absolute path, no "..", no drive letter).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def peft_base_name(base: BaseModel) -> str | None:
    """``base_model_name_or_path`` for a PEFT dir: the name a user resolves the base by.

    1. the hub id the base's config records (``_name_or_path``, when it has the ``owner/name`` form):
       what ``AutoPeftModelForCausalLM.from_pretrained`` downloads;
    2. else the base's path relative to the export service's model root (``base.label``: a model root
       laid out by hub id gives the hub id; never an absolute server path, which would tell clients the server's layout);
    3. an uploaded base (``artifact:<id>``): None, as PEFT writes for a model it cannot name.
    """
    recorded = str(base.config.get("_name_or_path") or "")
    if _HUB_ID.fullmatch(recorded) and ".." not in recorded:
        return recorded
    if base.label.startswith("artifact:") or Path(base.label).is_absolute() or ".." in Path(base.label).parts:
        return None
    return base.label


def write_peft_dir(out_dir: Path, adapter: Adapter, base: BaseModel, tokenizer_dir: Path | None) -> list[str]:
    """Write the vLLM-ready adapter dir; returns the files written.

    ``base_model_name_or_path`` names the base as :func:`peft_base_name` chooses.

    Raises:
        TargetRefused: the adapter uses something vLLM refuses (see ``refusals``).
    """
    why = refusals(adapter, base.arch.model_type)
    if why:
        raise TargetRefused(f"adapter {adapter.label!r} cannot be a vLLM LoRA adapter: " + "; ".join(why))
    tensors = {}
    for m in adapter.modules.values():
        if m.a_rows is not None:  # one expert of a fused experts pair: the pair is written as PEFT saved it
            for key in (m.a_key, m.b_key):
                tensors[key] = adapter.read(key).contiguous()
            continue
        a, b = (
            ("lora_A.weight", "lora_B.weight")
            if m.kind == "linear"
            else ("lora_embedding_A", "lora_embedding_B")
        )
        tensors[f"base_model.model.{m.module}.{a}"] = adapter.read(m.a_key).contiguous()
        tensors[f"base_model.model.{m.module}.{b}"] = adapter.read(m.b_key).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = dict(adapter.config)
    ranks = {m.module: m.r for m in adapter.modules.values() if m.a_rows is None} or {"": adapter.config["r"]}
    r = max(set(ranks.values()), key=list(ranks.values()).count)  # the most common rank is `r`
    cfg.update(
        peft_type="LORA",
        base_model_name_or_path=peft_base_name(base),
        r=r,
        rank_pattern={k: v for k, v in ranks.items() if v != r},
        target_modules=sorted(
            {m.module.rsplit(".", 1)[-1] for m in adapter.modules.values() if m.a_rows is None}
        ),
        bias="none",
        modules_to_save=None,
        use_dora=False,
        inference_mode=True,
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    files = ["adapter_model.safetensors", "adapter_config.json"]
    if tokenizer_dir is not None:
        import shutil

        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out_dir / name)
                files.append(name)
    return files


def check_vllm_lora_dir(d: Path, base: BaseModel) -> tuple[list[str], int | None]:
    """What vLLM's LoRA loader would refuse in ``d`` against ``base``; and the --max-lora-rank it needs."""
    problems: list[str] = []
    try:
        cfg: dict[str, Any] = read_json(d / "adapter_config.json", "adapter_config.json")
    except (OSError, ValueError) as exc:
        return [f"adapter_config.json unreadable: {exc}"], None
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        problems.append(f"adapter_config.json lacks required keys {missing}")
    r = cfg.get("r", 0)
    ranks = [r, *(cfg.get("rank_pattern") or {}).values()]
    if not isinstance(r, int) or r <= 0:
        problems.append(f"r must be a positive integer, got {r!r}")
    need = vllm_max_lora_rank(max(ranks)) if all(isinstance(x, int) for x in ranks) else None
    if need is None:
        problems.append(f"rank {max(ranks)} exceeds vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}")
    if cfg.get("use_dora"):
        problems.append("use_dora is true: vLLM does not yet support DoRA")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias is {cfg.get('bias')!r}: vLLM supports only 'none'")
    if cfg.get("lora_bias"):
        problems.append("lora_bias is true: vLLM does not support LoRA biases")
    if cfg.get("modules_to_save"):
        problems.append("modules_to_save is set: vLLM only supports None")
    wpath = d / "adapter_model.safetensors"
    if not wpath.is_file():
        return [*problems, "adapter_model.safetensors is missing"], need
    f = SafetensorsFile(wpath)
    targets = set(cfg.get("target_modules") or [])
    seen_modules = set()
    for key, e in f.entries.items():
        if not key.startswith("base_model.model."):
            problems.append(f"tensor {key!r} does not start with 'base_model.model.'")
            continue
        if moe.is_expert_lora(key):  # PEFT's target_parameters on fused experts (export_svc/core/moe.py)
            continue
        k = key.removeprefix("base_model.model.")
        suffixes = {
            ".lora_A.weight": "A",
            ".lora_B.weight": "B",
            ".lora_embedding_A": "eA",
            ".lora_embedding_B": "eB",
        }
        found = next((sfx for sfx in suffixes if k.endswith(sfx)), None)
        if found is None:
            problems.append(f"tensor {key!r} is not a lora_A/lora_B tensor")
            continue
        kind, module = suffixes[found], k.removesuffix(found)
        leaf = module.rsplit(".", 1)[-1]
        seen_modules.add(leaf)
        accepted = vllm_lora_modules(base.arch.model_type)
        if leaf not in accepted:
            problems.append(f"module {module!r} is not one vLLM supports ({sorted(accepted)})")
        bt = base.tensors.get(module + ".weight")
        if bt is None:
            problems.append(f"module {module!r} does not exist in the base")
            continue
        out_f, in_f = bt.shape if kind in ("A", "B") else (bt.shape[1], bt.shape[0])
        shape = tuple(e.shape)
        ok = (kind in ("A", "eA") and shape[1] == in_f) or (kind in ("B", "eB") and shape[0] == out_f)
        if not ok:
            problems.append(
                f"tensor {key!r} has shape {list(shape)}, base {module}.weight is {list(bt.shape)}"
            )
        if kind in ("A", "eA") and shape[0] not in ranks:
            problems.append(f"tensor {key!r} has rank {shape[0]}, adapter_config allows {sorted(set(ranks))}")
    if targets and not seen_modules <= targets and isinstance(cfg.get("target_modules"), list):
        problems.append(f"tensors adapt {sorted(seen_modules - targets)}, not listed in target_modules")
    if not seen_modules:
        problems.append("adapter_model.safetensors holds no LoRA tensors")
    scale_ok = isinstance(cfg.get("lora_alpha"), int | float) and cfg["lora_alpha"] > 0
    if not scale_ok:
        problems.append(f"lora_alpha must be positive, got {cfg.get('lora_alpha')!r}")
    elif isinstance(r, int) and r > 0 and not math.isfinite(cfg["lora_alpha"] / r):
        problems.append("lora_alpha / r is not finite")
    return problems, need
