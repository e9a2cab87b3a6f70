"""FSDP2 for a job on ranks (``TrainConfig.parallelism`` FSDP): the frozen base (16-bit or 4-bit) sharded.

DDP (the default) keeps a whole copy of the base on every device, so the base must fit one device. With FSDP2
(``torch.distributed.fsdp.fully_shard``) each rank holds 1/N of every parameter, the frozen base and the LoRA
tensors alike, and gathers one decoder layer's at a time for its forward and backward. The engine is the same
as DDP's: transformers' Trainer through accelerate (``fsdp_config["version"] = 2``: accelerate's
``fsdp2_prepare_model`` shards each decoder layer, the embeddings and the root), and gradients are
reduce-scattered instead of all-reduced. Rank 0 alone writes adapters and checkpoints, with full (gathered) LoRA
tensors in the single-process format: ``adapter_state_dict`` gathers the trainable tensors only, never the base.

Four things strop adds to the engines:

- accelerate turns FSDP on for accelerators only (``AcceleratorState`` upgrades MULTI_GPU, not MULTI_CPU); torch's
  FSDP2 itself runs on the CPU with gloo, so on the CPU (the test tier) ``enable_on_cpu`` turns it on the same way.
- transformers saves an FSDP checkpoint's model from ``Accelerator.get_state_dict``, which gathers the whole model
  (base included) onto rank 0; ``use_adapter_state_dict`` makes it gather the adapter only, which is all a LoRA
  checkpoint holds (on the CPU the whole-model path also fails outright: the gathered tensors alias FSDP's
  freed all-gather buffers, "Attempted to access the data pointer on an invalid python storage").
- strop's gradient guard reduces each tensor's max |grad| over the shards (``guard.py``).
- resuming with an optimizer that keeps no state (plain SGD) skips accelerate's optimizer load, which cannot
  handle an empty state, and restores the param groups' learning rate from the checkpoint itself
  (``skip_stateless_optimizer_load``).
- parameters are gathered as stored (``gather_as_stored``), not cast to bf16 as accelerate's policy for a bf16
  job would: the adapters stay fp32 under autocast and their gradients reduce in fp32, as in one process.

4-bit bases (bitsandbytes NF4) are sharded too. fully_shard turns each ``Params4bit`` into a DTensor sharded on
dim 0, which splits the packed codes evenly (the codes are bytes; the gathered tensor is the same bytes) and drops
the quant state (absmax, block size, shape) beside them; ``Linear4bit`` keeps its own reference to that state, from
which bitsandbytes' forward (and strop's fast path, ``kernels.models.proj_spec.base_weight``) puts it back on the
gathered weight. What stops the engines is the storage dtype: accelerate leaves uint8 ``Params4bit`` out of the
sharding (``ignored_params``: every rank would still hold the whole 4-bit base), and an FSDP2 mixed-precision
policy casts every sharded parameter to its ``param_dtype`` for the all-gather, which would turn packed bytes of
another dtype into numbers.
``shard_4bit_as_compute_dtype`` therefore re-labels each layer's packed bytes as words of the compute dtype (a
view, no copy: the same bytes, which bitsandbytes and strop's kernels read as bytes whatever the storage dtype, as
``bnb_4bit_quant_storage`` does at quantization time); FSDP2 then shards and gathers them with the rest and casts
nothing. (Findings behind this: accelerate issue #3983 and PR #3987, which added the exclusion; bitsandbytes PR
#970, which added ``quant_storage``.)

Bases larger than one device. A rank of a sharded job on accelerators loads the base into host memory
(``staging_device``), not onto its device. accelerate's ``fsdp2_prepare_model`` then calls ``fully_shard`` decoder
layer by decoder layer, bottom up, and each call moves that layer's parameters to the device and keeps 1/N of them
there (torch's ``_move_states_to_device``; a ``Params4bit``'s ``to`` moves its quant state along, the same object
``Linear4bit`` keeps). So the device holds 1/N of the base plus one layer whole while it is sharded, and 1/N plus
the gathered layers during the steps (``base_bytes_held``); admission counts those bytes before they arrive
(``device_bytes_after_sharding``). Until the sharding each rank holds a copy of the base in host memory, which the
sharding frees. (accelerate's own answer, ``cpu_ram_efficient_loading`` — rank 0 loads, the others build on meta
and receive their shards by broadcast — is disabled by accelerate for bitsandbytes models; strop does not use it.)

NF4 experts (a 4-bit Qwen3-MoE / Mixtral: ``kernels.models.moe_experts``) are sharded too, by ``shard_nf4_experts``.
Their storage is no ``Params4bit``: each stack's codes and absmax statistics are buffers of the experts module,
which ``fully_shard`` would leave whole on every rank, and the parameter PEFT wraps is a stride-0 placeholder of one
element, which ``fully_shard`` would copy out row by row (16-bit expert rows on every rank). So the codes and
statistics become frozen parameters of their module, relabelled as flat words of the stack's compute dtype as the
dense path's codes are (a view of the same bytes: torch 2.11's FSDP2 creates each sharded parameter requiring
gradients before freezing it, which a uint8 tensor cannot, and a mixed-precision cast leaves words of the compute
dtype alone), sharded on dim 0 with their decoder layer and gathered whole for its forward and backward, where the
grouped expert GEMM (or HF's path, through the module's dequantizing hook) views them back as the bytes quantized
and reads them as in one process; and every ``fully_shard`` call leaves the placeholders
out (``ignored_params``, ``leave_nf4_placeholders_alone``). The statistics' whole values are kept in host memory
before the sharding for the NF4 statistics file rank 0 writes (``moe.keep_expert_nf4_stats``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from strop.common.errors import FailedPrecondition, InvalidArgument
from strop.common.trainer_types import Parallelism, TrainConfig


def is_fsdp(cfg: TrainConfig) -> bool:
    return cfg.parallelism is Parallelism.FSDP and cfg.ranks() > 1


def check_supported(cfg: TrainConfig, fp8: bool = False) -> None:
    """Refuse FSDP where it cannot run: on one process, or over a session whose kernels run FP8 base GEMMs
    (``fp8``: the weights FSDP2 gathers carry no FP8 copies)."""
    if cfg.parallelism is not Parallelism.FSDP:
        return
    if fp8:
        raise FailedPrecondition(
            "parallelism FSDP does not combine with kernels ON_FP8 or ON_FP8_DX (the sharded weights FSDP2 "
            "gathers carry no FP8 copies): use DDP, or a session with kernels ON"
        )
    if cfg.ranks() <= 1:
        raise InvalidArgument(
            "parallelism FSDP shards the base over num_devices > 1 (or num_nodes > 1); "
            f"got num_devices {cfg.num_devices} on {max(cfg.num_nodes, 1)} node(s)"
        )


def staging_device(cfg: TrainConfig, device: str, world_size: int) -> str:
    """Where a rank loads the base: host memory for a sharded job on accelerators (FSDP2 moves each layer to the
    device as it shards it, so the base need not fit one device), else the rank's device."""
    if is_fsdp(cfg) and world_size > 1 and not device.startswith("cpu"):
        return "cpu"
    return device


def device_bytes_after_sharding(model, world_size: int) -> int:
    """What FSDP2 will place on a rank's device for a model still whole in host memory: 1/N of every parameter
    (base and adapters) plus two decoder layers gathered whole (the one computing and the one prefetched)."""
    total = _shardable_bytes(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [_shardable_bytes(m) for m in model.modules() if type(m).__name__ in names]
    return -(-total // world_size) + 2 * max(layers, default=0)


def _bytes(t) -> int:
    """The bytes ``t`` holds: none for NF4 experts' stride-0 placeholders (one element, which FSDP2 leaves alone)."""
    if t.numel() > 1 and 0 in t.stride():
        return 0
    return t.numel() * t.element_size()


def _shardable_bytes(module) -> int:
    """The bytes FSDP2 will shard in ``module``: its parameters and the NF4 experts' codes and statistics (buffers
    until ``shard_nf4_experts`` makes them parameters), the placeholders holding none."""
    from strop.kernels.models.moe_experts import SHARDABLE_ROLES

    nf4 = tuple(f"_nf4_{role}" for role in SHARDABLE_ROLES)
    held = sum(_bytes(p) for p in module.parameters())
    return held + sum(_bytes(b) for name, b in module.named_buffers() if name.endswith(nf4))


def shard_nf4_experts(model) -> int:
    """Make a model's NF4 expert stacks shardable by FSDP2 (module docstring): keep their statistics whole for the
    NF4 statistics file, then hold their codes and statistics as frozen parameters; the number of tensors moved
    (0 without NF4 experts). Before ``fully_shard``, after the adapter's metadata is read; every rank the same.

    Raises:
        FailedPrecondition: A stack's codes or statistics do not fill whole words of its compute dtype.
    """
    from strop.kernels.models.moe_experts import nf4_storage_as_parameters
    from strop.trainer_svc.core import moe

    if not moe.holds_nf4_experts(model):
        return 0
    moe.keep_expert_nf4_stats(model)
    try:
        return nf4_storage_as_parameters(model)
    except ValueError as e:
        raise FailedPrecondition(f"FSDP cannot shard the NF4 experts: {e}") from e


def leave_nf4_placeholders_alone() -> None:
    """Make every ``fully_shard`` call (accelerate's, on each decoder layer, the embeddings, the tail and the root)
    leave the NF4 experts' placeholders in the modules it shards out of the sharding (``ignored_params``); a no-op
    once installed. The rank process is this job's alone."""
    import torch.distributed.fsdp as torch_fsdp

    shard = torch_fsdp.fully_shard
    if getattr(shard, "_strop_leaves_placeholders", False):
        return
    from strop.kernels.models.moe_experts import nf4_placeholders

    @functools.wraps(shard)
    def fully_shard(module, *args, ignored_params=None, **kwargs):
        modules = module if isinstance(module, list | tuple) else [module]
        held = {p for m in modules for p in nf4_placeholders(m)}
        if held:
            ignored_params = set(ignored_params or ()) | held
        return shard(module, *args, ignored_params=ignored_params, **kwargs)

    fully_shard._strop_leaves_placeholders = True
    torch_fsdp.fully_shard = fully_shard


def nf4_expert_bytes_held(model) -> tuple[int, int]:
    """(bytes of the NF4 experts' codes and statistics this rank holds, bytes of the whole stacks): each sharded
    tensor's local shard against its global size, the buffers whole (bytes, whether held as words or as
    quantized)."""
    from torch.distributed.tensor import DTensor

    from strop.kernels.models.moe_experts import nf4_expert_modules

    held = whole = 0
    for module in nf4_expert_modules(model).values():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if "_nf4_" not in name:
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            held += local.numel() * local.element_size()
            whole += t.numel() * t.element_size()
    return held, whole


def shard_4bit_as_compute_dtype(model, dtype) -> int:
    """Store each bitsandbytes 4-bit layer's packed codes as ``dtype`` words (a view of the same bytes), so that
    accelerate shards them with the rest (it leaves uint8 codes out) and a mixed-precision cast to ``dtype``, if
    one were set, would leave them alone; the number of layers relabelled. Before ``fully_shard``; every rank the
    same.

    Raises:
        FailedPrecondition: A layer's packed bytes do not fill whole ``dtype`` words.
    """
    import torch

    try:
        from bitsandbytes.nn import Linear4bit, Params4bit
    except ImportError:  # no bitsandbytes: no 4-bit layers either
        return 0
    count, width = 0, dtype.itemsize
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear4bit) or mod.weight.dtype == dtype:
            continue
        w = mod.weight
        qs = w.quant_state
        data = w.data.reshape(-1).view(torch.uint8)
        if data.numel() % width:
            raise FailedPrecondition(
                f"FSDP cannot shard {name}: its {data.numel()} bytes of NF4 codes are not whole {dtype} words"
            )
        mod.weight = Params4bit(
            data.view(dtype).reshape(-1, 1),
            requires_grad=False,
            quant_state=qs,
            blocksize=qs.blocksize,
            compress_statistics=qs.nested,
            quant_type=qs.quant_type,
            quant_storage=dtype,
            module=mod,
            bnb_quantized=True,
        )
        mod.quant_state, mod.quant_storage = qs, dtype  # what the forward restores the gathered weight from
        count += 1
    return count


def base_bytes_held(model) -> tuple[int, int]:
    """(bytes of the frozen base this rank holds, bytes of the whole frozen base), counting each sharded tensor's
    local shard against its global size: the measure of what FSDP2 sharded."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        held += _bytes(local)
        whole += _bytes(p)
    return held, whole


def training_args(cfg: TrainConfig, model) -> dict:
    """transformers' TrainingArguments that make its Trainer shard ``model`` with FSDP2 (empty without FSDP)."""
    if not is_fsdp(cfg):
        return {}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(getattr(base, "_no_split_modules", None) or [])
    config = {
        "version": 2,
        "reshard_after_forward": True,  # ZeRO-3: a layer's gathered weights are freed after its forward
        "state_dict_type": "FULL_STATE_DICT",  # rank 0 writes whole tensors (of the adapter only, see above)
        "cpu_ram_efficient_loading": False,  # every rank loaded the base itself
    }
    if layers:
        config.update(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=layers)
    return {"fsdp": "full_shard", "fsdp_config": config}


def gather_as_stored(trainer) -> bool:
    """Make FSDP2 gather every parameter in the dtype it is stored in (``MixedPrecisionPolicy()``) for ``trainer``;
    True where the trainer shards with FSDP2. Before ``train()``, which shards the model.

    For a bf16 job accelerate sets ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``: the fp32 adapters
    are rounded to bf16 before each step's matmuls and their gradients reduced in bf16. One process and DDP keep
    the adapters fp32 under autocast (which rounds inside each matmul) and reduce fp32 gradients; measured on the
    H200 (``tests/kernels/models/test_fsdp_nf4.py``), accelerate's policy moves the LoRA gradients by 2% where the gather
    as stored gives them bitwise. Autocast (the Trainer's, for bf16) still computes in bf16, and the 4-bit codes,
    stored as compute-dtype words, are gathered as they are either way.
    """
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy()
    return True


def enable_on_cpu() -> None:
    """Let accelerate run FSDP on CPU ranks (gloo), as it does on accelerators; a no-op once installed."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_strop_fsdp_on_cpu", False):
        return
    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # every later AcceleratorState() (a singleton) copies PartialState's MULTI_CPU back in: upgrade it again
        plugin = fsdp_plugin or self.__dict__.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    __init__._strop_fsdp_on_cpu = True
    AcceleratorState.__init__ = __init__


def adapter_state_dict(model) -> dict:
    """The trainable (LoRA) tensors, whole, by state-dict name; a collective: every rank must call it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = full.detach().to("cpu", copy=True)  # never an alias of FSDP's gather buffers
    return out


def unshard_adapter(model) -> None:
    """Replace each sharded LoRA tensor by its whole, so rank 0's ``save_pretrained`` (``publish_adapter``) writes
    what a single process writes; a collective, after training: the model trains no more."""
    import torch
    from torch.distributed.tensor import DTensor

    for name, full in adapter_state_dict(model).items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(getattr(module, leaf), DTensor):
            setattr(module, leaf, torch.nn.Parameter(full, requires_grad=False))


def use_adapter_state_dict() -> None:
    """Make transformers' FSDP checkpoints gather the adapter only (``Accelerator.get_state_dict``, whose result
    PEFT's ``save_pretrained`` filters to the adapter anyway); a no-op once installed. The rank process is this
    job's alone, so patching the class touches no other job."""
    from accelerate import Accelerator

    if getattr(Accelerator.get_state_dict, "_strop_adapter_only", False):
        return
    whole = Accelerator.get_state_dict

    def get_state_dict(self, model, unwrap=True):
        if not self.is_fsdp2:
            return whole(self, model, unwrap=unwrap)
        return adapter_state_dict(model)

    get_state_dict._strop_adapter_only = True
    Accelerator.get_state_dict = get_state_dict


def stateless(optimizer) -> bool:
    """Whether ``optimizer`` keeps no per-parameter state (plain SGD: no momentum), so a checkpoint holds none."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    return isinstance(inner, torch.optim.SGD) and all(not g.get("momentum") for g in inner.param_groups)


def skip_stateless_optimizer_load() -> None:
    """Resuming an FSDP job whose optimizer keeps no state: transformers calls accelerate's ``load_fsdp_optimizer``,
    whose ``set_optimizer_state_dict`` needs at least one state tensor to learn the device from and raises
    ("Expected device to be set", torch 2.13) when there is none. There is no state to load then, only the param
    groups' hyperparameters, which ``restore_param_groups`` sets instead; the scheduler is loaded after it as usual.
    A no-op once installed; the rank process is this job's alone."""
    import transformers.trainer as hf_trainer

    load = hf_trainer.load_fsdp_optimizer
    if getattr(load, "_strop_skips_stateless", False):
        return

    def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, *args, **kwargs):
        if stateless(optimizer):
            index = args[0] if args else kwargs.get("optimizer_index", 0)
            return restore_param_groups(accelerator, optimizer, input_dir, index)
        return load(fsdp_plugin, accelerator, optimizer, model, input_dir, *args, **kwargs)

    load_fsdp_optimizer._strop_skips_stateless = True
    hf_trainer.load_fsdp_optimizer = load_fsdp_optimizer


def restore_param_groups(accelerator, optimizer, input_dir, optimizer_index: int = 0) -> bool:
    """Set ``optimizer``'s param groups' hyperparameters (the learning rate above all) to those of its checkpoint in
    ``input_dir`` (accelerate's whole-state file, which rank 0 wrote: rank 0 reads it and broadcasts the groups);
    whether there were any. A collective.

    Why. Loading an optimizer's state is what puts the learning rate of the checkpoint's step back into its param
    groups: the scheduler's ``load_state_dict`` restores only its own counters, and its next ``step`` sets the
    learning rate of the step after. Without this a resumed job's first step ran at the schedule's initial learning
    rate (``tests/trainer_svc/test_fsdp_moe.py``: twice the update at a linear schedule's midpoint)."""
    import torch
    import torch.distributed as dist
    from accelerate.utils.constants import OPTIMIZER_NAME

    groups = None
    if accelerator.is_main_process:
        name = f"{OPTIMIZER_NAME}.bin" if optimizer_index == 0 else f"{OPTIMIZER_NAME}_{optimizer_index}.bin"
        path = Path(input_dir) / name
        if path.is_file():
            groups = [
                {k: v for k, v in g.items() if k != "params"}
                for g in torch.load(path, weights_only=True)["param_groups"]
            ]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [groups]
        dist.broadcast_object_list(box, src=0)
        groups = box[0]
    if not groups:
        return False
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    for live, saved in zip(inner.param_groups, groups, strict=True):
        live.update(saved)
    return True


def prepare(device: str) -> None:
    """What a rank installs before its FSDP job's trainer is built."""
    if not device.startswith("cuda"):
        enable_on_cpu()
    use_adapter_state_dict()
    skip_stateless_optimizer_load()
    leave_nf4_placeholders_alone()
