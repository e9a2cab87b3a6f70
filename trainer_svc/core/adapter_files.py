"""What a saved adapter directory holds beside PEFT's files: the base's tokenizer files, the NF4 statistics of a
base quantized on load, and the record of the base it was trained on (``strop.common.adapter_base``), so the
directory alone re-creates the model as trained; and the base's quantization metadata that record carries."""

from __future__ import annotations

import shutil
from pathlib import Path

from strop.common import adapter_base
from strop.trainer_svc.core import moe
from strop.trainer_svc.core.loaded_model import LoadedModel

NF4_STATS_FILE = adapter_base.NF4_STATS_FILE
write_base_record = adapter_base.write_base_record  # checkpoints (jobs.publish_checkpoint) write it too


def write_adapter(loaded: LoadedModel, out_dir: Path) -> None:
    """PEFT adapter files (+ the base's tokenizer files, so exports have what they need; + the NF4 statistics
    of a base quantized on load, ``write_nf4_stats``; + the record of the base it was trained on,
    ``strop.common.adapter_base``, so the directory alone re-creates the model as trained)."""
    loaded.model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(loaded.model_dir, out_dir)
    if loaded.facts.quantization == "bnb-nf4-on-load":
        write_nf4_stats(loaded.model, out_dir / NF4_STATS_FILE)
    write_base_record(out_dir, adapter_metadata(loaded))


def write_nf4_stats(model, path: Path) -> int:
    """The scale statistics of every ``Linear4bit`` (absmax and, with double quant, its own quantization:
    offset, nested absmax and code), by base weight name; returns how many layers.

    Why. The exporter re-creates the NF4 codes of a base quantized on load from the 16-bit checkpoint, and
    the codes come out identical on CPU and CUDA (they depend only on each block's exact max). The double
    quantization of the absmax does not: its offset is a mean, summed in a different order by CUDA, so some
    8-bit absmax codes come out one step apart and move their blocks' weights (``bench/nf4_codes_check.py``;
    bench/RESULTS.md, "NF4 codes on CUDA vs the exporter"). These few MB (1 byte per 64
    weights) make the exporter's weights exactly the trained ones.
    """
    from bitsandbytes.nn import Linear4bit
    from safetensors.torch import save_file

    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear4bit):
            continue
        qs = quant_state_of(mod)
        key = name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
        out[key + ".absmax"] = qs.absmax.detach().cpu().contiguous()
        if qs.nested:
            out[key + ".offset"] = qs.offset.detach().float().cpu().reshape(1)
            out[key + ".nested_absmax"] = qs.state2.absmax.detach().cpu().contiguous()
            out[key + ".nested_code"] = qs.state2.code.detach().cpu().contiguous()
    out |= moe.expert_nf4_stats(model)  # NF4 experts' stacks, by stack name
    if out:
        save_file(out, str(path))
    return sum(k.endswith(".absmax") and not k.endswith(".nested_absmax") for k in out)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in adapter_base.TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def adapter_metadata(loaded: LoadedModel) -> dict[str, str]:
    return {
        "base_model": loaded.model_rel,
        "base_quantization": loaded.facts.quantization,
        "base_architecture": loaded.facts.architecture,
        "r": str(loaded.lora.r if loaded.lora else 0),
        **loaded_base_quant(loaded),
    }


def loaded_base_quant(loaded: LoadedModel) -> dict[str, str]:
    """``base_quant_metadata`` of the session's model as loaded, computed once: FSDP shards the base later (the
    digest then has only a rank's share of the codes to read) and relabels the codes' storage dtype."""
    if "base_quant" not in loaded.extra:
        loaded.extra["base_quant"] = base_quant_metadata(loaded.model)
    return loaded.extra["base_quant"]


def quant_state_of(mod):
    """A ``Linear4bit``'s quant state: its weight's, or (under FSDP2, whose sharded weight does not carry it) the
    module's own reference to the same state."""
    return getattr(mod.weight, "quant_state", None) or mod.quant_state


def base_quant_metadata(model) -> dict[str, str]:
    """How the base's 4-bit layers were quantized, read from their quant states (``base_quant.*``).

    The exporter re-creates the exact NF4 codes of a base quantized on load from these (its merge
    into "the model as trained"); empty for a 16-bit session.
    """
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # no bitsandbytes: no 4-bit layers either
        return {}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear4bit)]
    if not layers:
        return {}
    qs = quant_state_of(layers[0][1])
    first = layers[0][0].removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
    return {
        **_nf4_digest(first, layers[0][1].weight),
        "base_quant.type": str(qs.quant_type),
        "base_quant.blocksize": str(qs.blocksize),
        "base_quant.double_quant": str(bool(qs.nested)).lower(),
        "base_quant.nested_blocksize": str(qs.state2.blocksize if qs.nested else 0),
        "base_quant.quant_storage": str(layers[0][1].weight.quant_storage).removeprefix("torch."),
        "base_quant.quantized_from": str(qs.dtype).removeprefix("torch."),
        "base_quant.compute_dtype": str(layers[0][1].compute_dtype).removeprefix("torch."),
        "base_quant.modules": ",".join(
            sorted({n.replace(".base_layer", "").rsplit(".", 1)[-1] for n, _ in layers})
        ),
        "base_quant.tensors": str(len(layers)),
        **moe.expert_quant_metadata(model),
    }


def _nf4_digest(name: str, weight) -> dict[str, str]:
    """The digest of one Linear4bit weight (``kernels/ops/nf4_format.nf4_digest``, which the exporter compares its
    re-creation by). Skipped for a layer bitsandbytes repacked for CPU inference (its codes are in another
    layout then)."""
    from strop.kernels.ops.nf4_format import nf4_digest

    qs = weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        return {}
    return {"base_quant.digest_tensor": name, "base_quant.digest": nf4_digest(weight.data, qs)}
