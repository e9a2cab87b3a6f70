"""Mixtures of experts in exports: LoRA on fused expert parameters, merged into a per-expert checkpoint.

A trained MoE adapter (PEFT ``target_parameters``, ``trainer_svc/core/moe.py``) holds, for each layer's
``mlp.experts``, one LoRA pair per fused parameter: ``A [E·r, in]`` and ``B [out, E·r]``, expert ``e``'s factors
being (PEFT's ``ParamWrapper.get_delta_weight``)::

    A_e = A[e·r : (e+1)·r]          B_e = B[:, e::E]   (B reshaped [out, r, E], column i·E + e)
    ΔW_e = s · B_e @ A_e            [out, in]: gate_up_proj [2·I, H] (gate rows first, then up), down_proj [H, I]

Two wrappers nest on one experts module (the inner one's keys carry ``.base_layer.``); which parameter each
adapts is read from its shapes (gate_up: in H, out 2·I; down: in I, out H), never from the nesting order.
Qwen3-MoE and Mixtral checkpoints (what vLLM loads) hold each expert's projections as separate matrices
(``mlp.experts.{e}.gate_proj`` / Mixtral's ``block_sparse_moe.experts.{e}.w1``...), so each becomes a
:class:`~strop.export_svc.core.adapter_source.LoraModule` that slices its expert's rows out of ``A`` and its rows and
strided columns out of ``B``; the merge is then the dense one (``W + s · B @ A`` in fp32), tensor by tensor.

The reverse map (:func:`model_state`) turns such a checkpoint's tensors into the names and fused shapes of the
transformers model (``mlp.experts.gate_up_proj [E, 2·I, H]``), for the in-memory reference model verification
compares against.

NF4 experts (the trainer holds a 4-bit session's fused stacks as NF4, ``kernels/models/moe_experts.py``; the
adapter's ``base_quant.experts*`` metadata says so): the as-trained value of a per-expert tensor is read from its
layer's stack quantized again as the trainer did (:class:`ExpertNf4`: bitsandbytes' NF4 of ``[E, N·K]``, blocks of
64, double quant, from the recorded dtype), with the trainer's recorded absmax statistics where the adapter carries
them (the codes re-create exactly on any device, the double-quantized scales need not: ``write_nf4_stats``), and
dequantized exactly as the trainer's kernel does (rounded to that dtype, then fp32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from strop.common.archs import MOE_ARCHS, moe_sizes
from strop.export_svc.core.errors import BaseMismatch, CorruptInput

_EXPERT_KEY = re.compile(
    r"(?:base_model\.model\.)?(.+\.mlp\.experts)((?:\.base_layer)*)\.(lora_A|lora_B)\.weight"
)


def is_expert_lora(key: str) -> bool:
    """Whether an adapter tensor is a LoRA factor of a fused experts module."""
    return _EXPERT_KEY.fullmatch(key) is not None


def expert_pairs(keys) -> dict[tuple[str, str], dict[str, str]]:
    """``{(experts module, nesting): {"lora_A": key, "lora_B": key}}`` of an adapter's expert LoRA tensors."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for key in keys:
        m = _EXPERT_KEY.fullmatch(key)
        if m:
            out.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = key
    return out


def expert_slices(
    pairs: dict[tuple[str, str], dict[str, str]],
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any],
    *,
    adapter_label: str,
    base_label: str,
) -> list[dict[str, Any]]:
    """Per-expert merge modules of a base checkpoint for an adapter's expert LoRA ``pairs``: one dict of
    :class:`~strop.export_svc.core.adapter_source.LoraModule` fields (module, base_key, a_key, b_key, r, a_rows, b_rows,
    b_cols) for every expert tensor of the checkpoint a pair adapts, and ``experts_module`` (the adapted module's
    name, which PEFT's alpha_pattern matches).

    Raises:
        BaseMismatch: the base is not a mixture of experts, its layout has no per-expert tensors, or a pair's
            shapes fit neither fused parameter of the base's experts.
        CorruptInput: a pair lacks A or B, or its rank does not divide by the expert count.
    """
    arch = MOE_ARCHS.get(str(config.get("model_type")))
    if arch is None or not arch.moe.checkpoint_experts:
        raise BaseMismatch(
            f"adapter {adapter_label!r} adapts fused experts; base {base_label!r} ({config.get('model_type')!r}) "
            "has no per-expert checkpoint tensors to merge them into"
        )
    experts, _, inter = moe_sizes(config)
    hidden = int(config["hidden_size"])
    gate, up, down = arch.moe.checkpoint_experts
    out = []
    for (module, _nest), p in sorted(pairs.items()):
        if set(p) != {"lora_A", "lora_B"}:
            raise CorruptInput(
                f"adapter {adapter_label!r}: experts module {module!r} lacks its LoRA A or B tensor"
            )
        a_shape, b_shape = tuple(shapes[p["lora_A"]]), tuple(shapes[p["lora_B"]])
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] % experts:
            raise CorruptInput(
                f"adapter {adapter_label!r}: {module!r} A {list(a_shape)} / B {list(b_shape)} do not pair over "
                f"{experts} experts"
            )
        r = a_shape[0] // experts
        if (a_shape[1], b_shape[0]) == (hidden, 2 * inter):
            parts = {gate: (0, inter), up: (inter, 2 * inter)}
        elif (a_shape[1], b_shape[0]) == (inter, hidden):
            parts = {down: (0, hidden)}
        else:
            raise BaseMismatch(
                f"adapter {adapter_label!r}: {module!r} A {list(a_shape)} / B {list(b_shape)} fit neither "
                f"experts.gate_up_proj [{experts}, {2 * inter}, {hidden}] nor experts.down_proj "
                f"[{experts}, {hidden}, {inter}] of base {base_label!r}"
            )
        prefix = module.removesuffix(".mlp.experts") + f".{arch.moe.checkpoint_mlp}.experts"
        for e in range(experts):
            for leaf, rows in parts.items():
                out.append(
                    dict(
                        module=f"{prefix}.{e}.{leaf}",
                        experts_module=module,
                        base_key=f"{prefix}.{e}.{leaf}.weight",
                        a_key=p["lora_A"],
                        b_key=p["lora_B"],
                        r=r,
                        a_rows=(e * r, (e + 1) * r),
                        b_rows=rows,
                        b_cols=(e, experts),
                    )
                )
    return out


def checkpoint_name(config: dict[str, Any], model_name: str) -> str:
    """A transformers model's tensor name as the checkpoint names it (Mixtral's router: ``mlp.gate`` →
    ``block_sparse_moe.gate``); unchanged for every other tensor."""
    arch = MOE_ARCHS.get(str(config.get("model_type")))
    if arch is None or arch.moe.checkpoint_mlp == "mlp" or f".mlp.{arch.moe.router}." not in model_name:
        return model_name
    return model_name.replace(".mlp.", f".{arch.moe.checkpoint_mlp}.")


def model_state(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A per-expert checkpoint's tensors (``state``, checkpoint names) under the transformers model's names: each
    layer's experts stacked into ``mlp.experts.gate_up_proj [E, 2·I, H]`` (gate rows, then up) and
    ``mlp.experts.down_proj [E, H, I]``, the checkpoint's MLP name (Mixtral's ``block_sparse_moe``) as ``mlp``.
    A dense config's state is returned as it is."""
    arch = MOE_ARCHS.get(str(config.get("model_type")))
    if arch is None or not arch.moe.checkpoint_experts:
        return state
    experts, _, _ = moe_sizes(config)
    gate, up, down = arch.moe.checkpoint_experts
    mlp = arch.moe.checkpoint_mlp
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if f".{mlp}.experts." not in k:
            out[k.replace(f".{mlp}.", ".mlp.")] = v
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}.{mlp}.experts"
        if f"{p}.0.{gate}.weight" not in state:
            continue  # a dense layer (Qwen3-MoE's mlp_only_layers)
        q = f"model.layers.{i}.mlp.experts"
        out[f"{q}.gate_up_proj"] = torch.stack(
            [
                torch.cat([state[f"{p}.{e}.{gate}.weight"], state[f"{p}.{e}.{up}.weight"]])
                for e in range(experts)
            ]
        )
        out[f"{q}.down_proj"] = torch.stack([state[f"{p}.{e}.{down}.weight"] for e in range(experts)])
    return out


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight")


def expert_stacks(config: dict[str, Any], names: list[str]) -> dict[str, tuple[str, int, int]]:
    """For each per-expert tensor among ``names``: the stacked tensor it is expert ``e`` of, as llama.cpp's MoE tensors
    hold a layer's experts (``blk.i.ffn_{gate,up,down}_exps``: ``[E, out, in]``), named the way gguf-py's tensor map
    knows it (``model.layers.i.mlp.experts.gate_proj.weight``), ``e`` and ``E``. Empty for a dense config."""
    arch = MOE_ARCHS.get(str(config.get("model_type")))
    if arch is None or not arch.moe.checkpoint_experts:
        return {}
    experts, _, _ = moe_sizes(config)
    out = {}
    for n in names:
        m = _PER_EXPERT.fullmatch(n)
        if m:
            out[n] = (f"{m.group(1)}.{m.group(3)}.weight", int(m.group(2)), experts)
    return out


EXPERTS_META = "base_quant.experts"  # "nf4" when the trainer held the fused expert stacks in NF4
EXPERTS_FROM_META = "base_quant.experts_from"  # the dtype the stacks had when quantized
EXPERTS_DIGEST_META = ("base_quant.experts_digest_stack", "base_quant.experts_digest")  # one stack's, by name


@dataclass
class ExpertNf4:
    """How the trainer held a 4-bit session's expert stacks (NF4, blocks of 64, double quant), to re-create them."""

    config: dict[str, Any]
    quantized_from: str
    stats_file: str = ""
    digest_stack: str = ""  # one stack the trainer hashed (codes and absmax statistics) ...
    digest: str = ""  # ... and its sha256 (``nf4_format.nf4_digest``)
    _cache: tuple[str, torch.Tensor] | None = (
        None  # the last stack dequantized (a merge walks expert by expert)
    )

    @classmethod
    def from_metadata(
        cls, meta: dict[str, str], config: dict[str, Any], stats_file: str = ""
    ) -> ExpertNf4 | None:
        """The adapter's record of NF4 experts, or None when its experts were held in 16 bits.

        Raises:
            CorruptInput: a quantization strop does not write.
        """
        kind = meta.get(EXPERTS_META, "")
        if not kind:
            return None
        dtype = meta.get(EXPERTS_FROM_META, "")
        if kind != "nf4" or dtype not in ("bfloat16", "float16", "float32"):
            raise CorruptInput(
                f"the adapter records experts held as {kind!r} from {dtype!r}: strop writes nf4"
            )
        return cls(
            config,
            dtype,
            stats_file,
            meta.get(EXPERTS_DIGEST_META[0], ""),
            meta.get(EXPERTS_DIGEST_META[1], ""),
        )

    def check_codes(self, base) -> str:
        """Whether the stacks re-created from ``base`` are the trainer's: ``"bit-identical"``, ``"differ"`` or
        ``"not recorded"`` (the digest of one stack's codes and absmax statistics against the trainer's)."""
        from strop.kernels.ops.nf4_format import nf4_digest

        names = self._checkpoint_names(self.digest_stack) if self.digest else None
        if not names or any(n not in base.tensors for n in names):
            return "not recorded"
        packed, qs = self._quantized(base, self.digest_stack, names)
        return "bit-identical" if nf4_digest(packed, qs) == self.digest else "differ"

    def _checkpoint_names(self, stack: str) -> list[str] | None:
        """The checkpoint tensors a stack (``model.layers.i.mlp.experts.gate_up_proj``) is made of, in order."""
        arch = MOE_ARCHS.get(str(self.config.get("model_type")))
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", stack)
        if arch is None or not arch.moe.checkpoint_experts or m is None:
            return None
        gate, up, down = arch.moe.checkpoint_experts
        prefix = f"{m.group(1)}.{arch.moe.checkpoint_mlp}.experts"
        leaves = (down,) if m.group(2) == "down_proj" else (gate, up)
        return [f"{prefix}.{e}.{x}.weight" for e in range(moe_sizes(self.config)[0]) for x in leaves]

    def stack_of(self, name: str) -> tuple[str, list[str], int, tuple[int, int]] | None:
        """For a per-expert checkpoint tensor: (its stack's model name, the checkpoint names stacked in it in
        order, its expert, its rows in that expert's matrix); None for any other tensor."""
        arch = MOE_ARCHS.get(str(self.config.get("model_type")))
        m = _PER_EXPERT.fullmatch(name)
        if arch is None or not arch.moe.checkpoint_experts or m is None:
            return None
        experts, _, inter = moe_sizes(self.config)
        hidden = int(self.config["hidden_size"])
        gate, up, down = arch.moe.checkpoint_experts
        prefix, e, leaf = m.group(1), int(m.group(2)), m.group(3)
        layer = prefix.removesuffix(f".{arch.moe.checkpoint_mlp}.experts") + ".mlp.experts"
        if leaf == down:
            return (
                f"{layer}.down_proj",
                [f"{prefix}.{i}.{down}.weight" for i in range(experts)],
                e,
                (0, hidden),
            )
        rows = (0, inter) if leaf == gate else (inter, 2 * inter)
        names = [f"{prefix}.{i}.{x}.weight" for i in range(experts) for x in (gate, up)]
        return f"{layer}.gate_up_proj", names, e, rows

    def read(self, base, name: str) -> torch.Tensor:
        """The fp32 values the trainer's kernel multiplied for per-expert tensor ``name`` of ``base``."""
        stack, names, e, (lo, hi) = self.stack_of(name)
        if self._cache is None or self._cache[0] != stack:
            self._cache = None  # free the previous stack first
            self._cache = (stack, self._dequantized(base, stack, names))
        return self._cache[1][e, lo:hi].clone()

    def _quantized(self, base, stack: str, names: list[str]):
        """The stack's NF4 codes and quant state as the trainer made them (its recorded scales where it has them)."""
        from bitsandbytes.functional import quantize_4bit

        experts = moe_sizes(self.config)[0]
        dtype = getattr(torch, self.quantized_from)
        rows = torch.cat([base.files[base.tensors[n].file].read(n).to(dtype).reshape(-1) for n in names])
        packed, qs = quantize_4bit(
            rows.view(experts, -1), blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        if self.stats_file:
            _recorded_scales(self.stats_file, stack, qs)
        return packed, qs

    def _dequantized(self, base, stack: str, names: list[str]) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        packed, qs = self._quantized(base, stack, names)
        experts = moe_sizes(self.config)[0]
        return dequantize_4bit(packed, qs).float().view(experts, -1, _in_features(self.config, stack))


def _in_features(config: dict[str, Any], stack: str) -> int:
    return int(config["hidden_size"]) if stack.endswith("gate_up_proj") else moe_sizes(config)[2]


def _recorded_scales(path: str, stack: str, qs) -> None:
    """``qs``'s absmax statistics replaced by the trainer's for ``stack`` (keys as ``write_nf4_stats``'s)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        want = [stack + s for s in (".absmax", ".offset", ".nested_absmax", ".nested_code")]
        if any(k not in keys for k in want):
            raise CorruptInput(f"the adapter's recorded NF4 statistics lack the expert stack {stack!r}")
        absmax = f.get_tensor(stack + ".absmax")
        if absmax.shape != qs.absmax.shape or absmax.dtype != qs.absmax.dtype:
            raise CorruptInput(
                f"the adapter's recorded NF4 statistics of {stack!r} do not fit its base experts"
            )
        qs.absmax = absmax
        qs.offset = f.get_tensor(stack + ".offset").reshape(qs.offset.shape).to(qs.offset.dtype)
        qs.state2.absmax = f.get_tensor(stack + ".nested_absmax")
        qs.state2.code = f.get_tensor(stack + ".nested_code")
