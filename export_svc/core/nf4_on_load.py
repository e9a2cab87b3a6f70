"""How the trainer quantized a 16-bit base on load (``Nf4OnLoad``), read from an adapter artifact's metadata, so an
export re-creates the NF4 codes the adapter was trained against (``BaseModel.quantized_on_load``)."""

from __future__ import annotations

from dataclasses import dataclass

from strop.export_svc.core.errors import CorruptInput

# The dtypes a 16-bit base may have been quantized from (the merged checkpoint's dtypes: ``base_source.DTYPES``).
_FROM_DTYPES = ("bfloat16", "float16", "float32")

# The leaf modules transformers' bitsandbytes integration turns into Linear4bit in the families strop
# supports (every nn.Linear but lm_head): what an older trainer artifact, which records no module list,
# had quantized on load.
_LINEAR4BIT_MODULES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
QUANT_META_PREFIX = "base_quant."  # the trainer's adapter-artifact metadata keys of the 4-bit settings


@dataclass(frozen=True)
class Nf4OnLoad:
    """How the trainer quantized a 16-bit base when it loaded it (bitsandbytes ``Linear4bit``).

    Read from the adapter artifact's ``base_quant.*`` metadata (the trainer writes it from its
    layers' quant states); with those settings bitsandbytes' ``quantize_4bit`` re-creates the exact
    codes and absmax the adapter was trained against (``tests/export_svc/test_as_trained.py`` checks
    it bitwise against the trainer's own ``Linear4bit`` weights).
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    nested_blocksize: int = 256  # the absmax's own 8-bit quantization (bitsandbytes' fixed choice)
    quant_storage: str = "uint8"
    quantized_from: str = "float32"  # the dtype the weights had when they were quantized
    compute_dtype: str = "float32"
    modules: tuple[str, ...] = _LINEAR4BIT_MODULES  # leaf names of the Linear4bit layers
    tensors: int = 0  # how many weights were quantized (0: not recorded)
    assumed: bool = False  # an older artifact: the trainer's fixed on-load settings, not read from it
    digest_tensor: str = ""  # one weight whose codes and absmax the trainer hashed ...
    digest: str = ""  # ... and their sha256 (see ``nf4_digest``)
    # the trainer's recorded scale statistics (absmax, and the double quantization's offset, nested absmax and
    # code) by weight name: the codes re-create exactly on any device, the double-quantized scales do not
    # (trainer_svc/core/adapter_files.py ``write_nf4_stats``); "" for artifacts written before they were recorded
    stats_file: str = ""

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Nf4OnLoad | None:
        """The settings an adapter artifact records, or None when its base was not quantized on load.

        Raises:
            CorruptInput: recorded settings that do not parse.
        """
        if meta.get("base_quantization") != "bnb-nf4-on-load":
            return None
        q = {k.removeprefix(QUANT_META_PREFIX): v for k, v in meta.items() if k.startswith(QUANT_META_PREFIX)}
        if not q:  # written before the trainer recorded them: its settings were fixed (models.load_model)
            return cls(assumed=True)
        try:
            spec = cls(
                quant_type=q.get("type", "nf4"),
                blocksize=int(q.get("blocksize", "64")),
                double_quant=q.get("double_quant", "true") == "true",
                nested_blocksize=int(q.get("nested_blocksize", "256")),
                quant_storage=q.get("quant_storage", "uint8"),
                quantized_from=q.get("quantized_from", "float32"),
                compute_dtype=q.get("compute_dtype", "float32"),
                modules=tuple(sorted(m for m in q.get("modules", "").split(",") if m)) or _LINEAR4BIT_MODULES,
                tensors=int(q.get("tensors", "0")),
                digest_tensor=q.get("digest_tensor", ""),
                digest=q.get("digest", ""),
            )
        except ValueError as exc:
            raise CorruptInput(f"the adapter's base_quant.* metadata does not parse: {exc}") from None
        if spec.quant_type not in ("nf4", "fp4") or spec.quantized_from not in _FROM_DTYPES:
            raise CorruptInput(
                f"the adapter records an on-load quantization strop cannot re-create: {spec.quant_type} "
                f"from {spec.quantized_from}"
            )
        return spec

    def covers(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the base tensor ``name`` was a Linear4bit weight in the trainer."""
        return (
            len(shape) == 2
            and name.endswith(".weight")
            and name[: -len(".weight")].rsplit(".", 1)[-1] in self.modules
        )

    def describe(self) -> str:
        dq = ", double quant" if self.double_quant else ""
        scales = ", the trainer's recorded scales" if self.stats_file else ", scales re-computed"
        return f"bnb-{self.quant_type} (blocksize {self.blocksize}{dq}, quantized from {self.quantized_from}{scales})"

    def recorded_scales(self, name: str, qs) -> None:
        """Replace ``qs``'s scale statistics with those the trainer recorded for weight ``name`` (no-op
        without a stats file). Raises CorruptInput when the file lacks the weight or disagrees in shape."""
        if not self.stats_file:
            return
        from safetensors import safe_open

        with safe_open(self.stats_file, framework="pt") as f:
            keys = set(f.keys())
            want = [name + ".absmax"] + (
                [name + s for s in (".offset", ".nested_absmax", ".nested_code")] if qs.nested else []
            )
            missing = [k for k in want if k not in keys]
            if missing:
                raise CorruptInput(f"the adapter's recorded NF4 statistics lack {missing[0]!r}")
            absmax = f.get_tensor(name + ".absmax")
            if absmax.shape != qs.absmax.shape or absmax.dtype != qs.absmax.dtype:
                raise CorruptInput(
                    f"the adapter's recorded NF4 statistics of {name!r} do not fit its base weight"
                )
            qs.absmax = absmax
            if qs.nested:
                qs.offset = f.get_tensor(name + ".offset").reshape(qs.offset.shape).to(qs.offset.dtype)
                qs.state2.absmax = f.get_tensor(name + ".nested_absmax")
                qs.state2.code = f.get_tensor(name + ".nested_code")
