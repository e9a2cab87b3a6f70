"""The step API's device work on one session's model: runs as PEFT named adapters on the one base, and the
primitives (forward_backward, optim_step, state save/load, sampler snapshots) as plain torch. No gRPC, no
queueing (``runs.py`` owns those).

How runs share the base. Each run is a PEFT adapter named after the run on the session's one model
(``add_adapter``); a primitive makes its run's adapter the active one (``activate``) and runs. strop's fused LoRA
kernels read the layer's active adapter on every call (``kernels/models/proj_spec.py``: ``layer_spec``), so they compute
with whichever run is active, and nothing is copied per primitive. The alternative, one adapter slot whose
tensors are swapped in per primitive, copies adapter-sized tensors (an 8B model's r=16 adapter is ~170 MB in
fp32) twice a primitive and forces every run to one rank and target set; named adapters cost nothing to switch
(a few hundred attribute writes) and let each run pick its rank. Gradients land in the active run's own
parameters (the others have ``requires_grad`` off), so runs never touch each other's gradients, and each run
has its own AdamW over its own parameters.

A sampler snapshot (SaveWeightsForSampler) is another named adapter, a frozen copy of the run's tensors, which
Sample activates while the run trains on.

On a mixture of experts, ``train_mlp`` is LoRA on every expert's gate/up/down as a job's LoRA config puts it
(``moe.peft_targets``: PEFT's ``target_parameters`` on the fused expert stacks, a rank-r pair per expert). PEFT
keeps one ``ParamWrapper`` per stack holding every run's pair by name, and strop's grouped expert GEMM reads the
active run's pair on each call (``kernels/models/moe_experts.expert_factors``), as the dense layers' kernels do.
The loss is the loss function's alone: the router is frozen and its load-balancing term is not added.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from strop.common.errors import FailedPrecondition, InvalidArgument
from strop.common.step_types import DEFAULT_RUN_LORA_ALPHA, RunLora
from strop.kernels.losses.logps import token_logps_trainable_head
from strop.kernels.losses.rl import per_token_loss
from strop.trainer_svc.core import model_loading, moe

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
STATE_FILE = "run_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
DEAD_ADAPTERS = "step_dead_adapters"  # LoadedModel.extra: deleted adapters PEFT could not drop (the last one)


def _linear_names(model) -> set[str]:
    """Leaf names of the model's linear layers, wrapped by PEFT or not (without the LM head)."""
    return model_loading.linear_module_names(model) | {
        name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "base_layer")
    }  # a PEFT-wrapped model's projections are LoRA layers over their linear base_layer


def target_modules(model, lora: RunLora) -> list[str]:
    """Tinker's ``train_attn``/``train_mlp``/``train_unembed`` as the projection names this model has (on a
    mixture of experts, gate/up/down name its experts' fused stacks: :func:`peft_targets`)."""
    have = _linear_names(model)
    if moe.moe_arch(model.config) is not None:
        have |= set(moe.EXPERT_TARGETS)
    wanted = (ATTN_MODULES if lora.train_attn else ()) + (MLP_MODULES if lora.train_mlp else ())
    out = [m for m in wanted if m in have]
    if lora.train_unembed:
        out.append("lm_head")
    if not out:
        raise InvalidArgument("lora: at least one of train_attn, train_mlp, train_unembed must be true")
    return out


def peft_targets(model, targets: list[str]) -> moe.PeftTargets:
    """PEFT's targets for a run's projection names (:func:`target_modules`): linear layers by name, an MoE's
    expert stacks as parameters (``moe.peft_targets``, as a job's LoRA config), the router frozen."""
    head = [t for t in targets if t in UNEMBED_MODULES]
    rest = [t for t in targets if t not in UNEMBED_MODULES]
    found = moe.peft_targets(model.config, rest, _linear_names(model), dropout=0.0, train_router=False)
    return replace(found, target_modules=found.target_modules + head)


def adapter_numel(model, lora: RunLora) -> int:
    """Parameters of the adapter :func:`add_adapter` gives ``lora`` on ``model``, from the shapes alone: r·(in + out)
    per targeted linear layer and E·r·(in + out) per targeted expert stack [E, out, in] (PEFT's ``ParamWrapper``:
    a rank-r pair per expert; gpt-oss's transposed stacks sum the same)."""
    found = peft_targets(model, target_modules(model, lora))
    r, n = lora.rank, 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in found.target_modules:
            layer = getattr(m, "base_layer", m)
            n += r * (layer.in_features + layer.out_features)
    stacks = {t.rsplit(".", 1)[-1] for t in found.target_parameters}
    for name, p in model.named_parameters():
        if ".experts." in name and name.rsplit(".", 1)[-1] in stacks and p.dim() == 3:
            n += r * p.shape[0] * (p.shape[1] + p.shape[2])
    return n


def _adapter_params(model, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    tag = f".{adapter}."
    return [(n, p) for n, p in model.named_parameters() if tag in n]


def add_adapter(
    loaded: model_loading.LoadedModel, adapter: str, lora: RunLora, *, trainable: bool
) -> list[str]:
    """Add a LoRA adapter named ``adapter`` (weights fp32, initialised from ``lora.seed`` without touching the
    global RNG); returns its target modules. The first adapter wraps the model with PEFT (and, on the kernels'
    path, patches it)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    targets = target_modules(loaded.model, lora)
    found = peft_targets(loaded.model, targets)
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=DEFAULT_RUN_LORA_ALPHA if lora.alpha is None else lora.alpha,
        lora_dropout=0.0,
        target_modules=found.target_modules,
        target_parameters=found.target_parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(lora.seed or 0))
        if isinstance(loaded.model, PeftModel):
            wrapped = _wrapped(loaded.model)
            loaded.model.add_adapter(adapter, cfg)
            if loaded.facts.kernels_enabled and _wrapped(loaded.model) != wrapped:
                # PEFT wrapped layers the kernels were patched without (earlier runs left them out, e.g. an MoE's
                # experts): patch again, or this run's calls there would take PEFT's path
                loaded.kernel_report = model_loading.apply_kernels(loaded)
        else:
            loaded.model = get_peft_model(
                loaded.model, cfg, adapter_name=adapter, autocast_adapter_dtype=True
            )
            if loaded.device.startswith("cuda"):
                # as the jobs' default and bench/train_bench.py's "strop" system (checkpointing on before the
                # kernels patch the model): each layer recomputed in backward, so a ForwardBackward holds one
                # layer's activations, not all of them
                loaded.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            if loaded.facts.kernels_enabled:
                loaded.kernel_report = model_loading.apply_kernels(loaded)
            loaded.model.train()  # HF checkpoints layers only in training mode (LoRA runs have no dropout)
    for _, p in _adapter_params(loaded.model, adapter):
        p.data = p.data.float()  # adapters and their optimizer state in fp32 over a 16/4-bit base
        p.requires_grad_(trainable)
    for dead in loaded.extra.pop(DEAD_ADAPTERS, set()):
        loaded.model.delete_adapter(dead)
    return targets


def _wrapped(model) -> set[str]:
    """Names of the modules PEFT wrapped (LoRA layers and expert ``ParamWrapper``s hold a ``base_layer``)."""
    return {name for name, m in model.named_modules() if "base_layer" in m._modules}


def delete_adapter(loaded: model_loading.LoadedModel, adapter: str) -> None:
    """Remove a run's (or snapshot's) adapter. PEFT keeps at least one adapter on a model: the last one stays,
    zeroed (its B factors: it adds nothing) and frozen, until the next ``add_adapter`` removes it."""
    model = loaded.model
    if adapter not in getattr(model, "peft_config", {}):
        return
    if len(model.peft_config) == 1:
        with torch.no_grad():
            for name, p in _adapter_params(model, adapter):
                p.grad = None
                p.requires_grad_(False)
                if "lora_B" in name:
                    p.zero_()
        loaded.extra.setdefault(DEAD_ADAPTERS, set()).add(adapter)
        return
    model.delete_adapter(adapter)


def activate(loaded: model_loading.LoadedModel, adapter: str, *, trainable: bool) -> None:
    """Make ``adapter`` the active one; only its parameters require grad when ``trainable``."""
    model = loaded.model
    if model.active_adapter != adapter:
        model.set_adapter(adapter)
    for name, p in model.named_parameters():
        if "lora_" in name:
            want = trainable and f".{adapter}." in name
            if p.requires_grad != want:
                p.requires_grad_(want)


@dataclass
class Batch:
    """Datums padded into one batch: ``tokens``/``mask`` [B, T]; per-token loss inputs concatenated over the
    datums' real positions (row-major, the order ``hidden[mask]`` takes)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    k: int = 1  # target candidates per position: [N, K] cross_entropy scores each row against K tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def make_batch(model_inputs: list[list[int]], inputs: list[dict[str, list]], device: str) -> Batch:
    lengths = [len(t) for t in model_inputs]
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, t in enumerate(model_inputs):
        tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, : len(t)] = 1
    cat: dict[str, torch.Tensor] = {}
    for key in inputs[0]:
        dtype = torch.long if key == "target_tokens" else torch.float32
        cat[key] = torch.tensor([v for d in inputs for v in d[key]], dtype=dtype, device=device)
    k = len(inputs[0]["target_tokens"]) // lengths[0]  # candidates per position (validated alike for all)
    return Batch(tokens.to(device), mask.to(device), lengths, cat, k)


def hidden_rows(loaded: model_loading.LoadedModel, batch: Batch) -> torch.Tensor:
    """Final hidden states (after the last norm) of every real position, [M, H] in datum order."""
    base = loaded.model.get_base_model()
    out = base.model(input_ids=batch.tokens, attention_mask=batch.mask, use_cache=False)
    return out.last_hidden_state[batch.mask.bool()]


def _head(loaded: model_loading.LoadedModel):
    """(frozen weight, bias) of the LM head, or the head module itself when the active run trains it."""
    head = loaded.model.get_base_model().lm_head
    base = getattr(head, "base_layer", head)
    active = loaded.model.active_adapter
    trains_head = hasattr(head, "lora_A") and active in head.lora_A
    return base.weight, getattr(base, "bias", None), (head if trains_head else None)


def forward_backward(
    loaded: model_loading.LoadedModel,
    batch: Batch,
    loss_fn: str,
    cfg: dict[str, float],
    *,
    backward: bool,
) -> tuple[float, list[list[float]]]:
    """The active run's loss (a sum) and each datum's target log-probs; gradients accumulate into the run's
    parameters when ``backward``. Log-probs come chunked over the hidden rows (never the full logits)."""
    softcap = getattr(loaded.model.get_base_model().config, "final_logit_softcapping", None)
    weight, bias, head = _head(loaded)
    logps = None
    if head is not None:

        def logps(rows, targets):
            return token_logps_trainable_head(rows, head, targets, softcap=softcap)

    if backward:  # as a job: Generate's copies (a CPU session's dequantized 4-bit layers, its fp32 head) go
        model_loading.drop_inference_weights(loaded)
    grad = torch.enable_grad() if backward else torch.no_grad()
    mode = memory_mode(loaded, batch) if backward else contextlib.nullcontext()
    with mode:  # installed from the forward through the backward (its recompute reloads the offloaded inputs)
        with grad, loaded.compute_autocast():
            rows = hidden_rows(loaded, batch)
            if batch.k > 1:  # each row scored against its K candidates, in [N, K] row-major order
                rows = rows.repeat_interleave(batch.k, dim=0)
            loss, lp = per_token_loss(
                loss_fn, rows, weight, batch.inputs, cfg, bias=bias, softcap=softcap, logps=logps
            )
        if backward:
            loss.backward()
    lp = lp.detach().float().cpu().tolist()
    out, start = [], 0
    for n in batch.lengths:
        out.append(lp[start : start + n * batch.k])
        start += n * batch.k
    return float(loss.detach()), out


# tests: install the memory mode on a CPU session too, with these apply_memory_mode keywords (offload_cpu_tensors,
# min_offload_bytes) so the offload path runs with CPU tensors; None: CUDA with the kernels only, as the jobs
_MEMORY_MODE_ON_CPU: dict[str, Any] | None = None


@contextlib.contextmanager
def memory_mode(loaded: model_loading.LoadedModel, batch: Batch):
    """The jobs' default memory mode (``DEFAULT_MEMORY_MODE``: layer inputs offloaded to pinned host memory and
    attention outputs kept there, each when the host has room) around one ForwardBackward, installed by the one
    owner (``apply_memory_mode``) on CUDA with the kernels, as ``training._install_memory_mode`` does for a job.

    It is installed per ForwardBackward and removed after it, sized from this batch (rows, longest row), because
    a batch's shape changes per call and because Forward and Sample must run on the plain model (the sampler's
    KV-cache decode is no checkpointed training forward). Named adapters are safe under it: the offloader hooks
    the decoder layers' checkpoint function, which sees hidden states, never an adapter; the recompute in backward
    runs the same layer with the same active adapter (nothing switches adapters inside a primitive). Budgeted
    recompute (MAX_SPEED, a plan measured over the first steps) is not used here: the step path has no stable
    step shape to plan for."""
    on_cuda = loaded.device.startswith("cuda") and loaded.facts.kernels_enabled
    if not on_cuda and _MEMORY_MODE_ON_CPU is None:
        yield None
        return
    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode

    installed = apply_memory_mode(
        loaded.model,
        MemoryMode.UNSPECIFIED,
        step=StepShape(len(batch.lengths), max(batch.lengths), True),
        device=loaded.device,
        **({} if on_cuda else _MEMORY_MODE_ON_CPU),
    )
    try:
        yield installed
    finally:
        # what the last ForwardBackward ran with (logs, tests)
        loaded.extra["step_memory_mode"] = str(installed)
        installed.remove()


def run_params(loaded: model_loading.LoadedModel, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters by name without the adapter's own name (so states move between runs)."""
    return [(n.replace(f".{adapter}.", "."), p) for n, p in _adapter_params(loaded.model, adapter)]


def move_run_state(params: list[torch.nn.Parameter], opt: torch.optim.AdamW, device: str) -> None:
    """Move a run's parameters, gradients and Adam moments to ``device`` in place (the same Parameter objects,
    so the optimizer and PEFT keep them); Adam's step counters stay where torch keeps them (host scalars)."""
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    opt.state[p][key] = value.to(device)


def new_optimizer(params: list[torch.nn.Parameter], adam: dict[str, float]) -> torch.optim.AdamW:
    # foreach left to torch: the grouped (multi-tensor) kernels when every parameter is on CUDA, the per-parameter
    # loop otherwise (the CPU tier's by-hand check). The per-parameter loop on CUDA is ~10 launches per tensor,
    # 448 tensors on an 8B model with the seven projections: most of OptimStep's time at that size. LoadState's
    # bit-identical continuation holds either way (both runs take the same implementation).
    return torch.optim.AdamW(
        params,
        lr=adam["learning_rate"],
        betas=(adam["beta1"], adam["beta2"]),
        eps=adam["eps"],
        weight_decay=adam["weight_decay"],
    )


def optim_step(opt: torch.optim.AdamW, params: list[torch.nn.Parameter], adam: dict[str, float]) -> dict:
    """Apply AdamW with this step's hyperparameters, then zero the gradients; the metrics Tinker-style.

    Grouped (``torch._foreach_*``) kernels and two host syncs whatever the number of tensors: one for the gradient
    norm (the finite check and clipping need it on the host), one for the metrics."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise FailedPrecondition("the run has no gradients: call ForwardBackward before OptimStep")
    norm = float(_norm(grads))
    if not math.isfinite(norm):
        opt.zero_grad(set_to_none=True)
        raise FailedPrecondition(
            f"the gradient norm is {norm}; the step is skipped and the gradients dropped"
        )
    clip = adam["grad_clip_norm"]
    clipped = clip > 0 and norm > clip
    if clipped:
        torch._foreach_mul_(grads, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
    for group in opt.param_groups:
        group.update(
            lr=adam["learning_rate"],
            betas=(adam["beta1"], adam["beta2"]),
            eps=adam["eps"],
            weight_decay=adam["weight_decay"],
        )
    with torch.no_grad():
        weights = [p.detach() for p in params]
        before = torch._foreach_mul(weights, 1.0)  # an exact copy, one grouped launch
        opt.step()
        opt.zero_grad(set_to_none=True)
        update, param_norm = torch.stack(
            [_norm(torch._foreach_sub(weights, before)), _norm(weights)]
        ).tolist()
    # Tinker's SDK names no OptimStep metric (OptimStepResponse.metrics is a free dict[str, float]); its metric
    # keys are "name:reduction", reduction one of mean/sum/min/max/slack/hash_unordered/unique (the SDK's
    # lib/chunked_fwdbwd_helpers.py REDUCE_MAP), and "grad_norm:mean" is the key Tinker-compatible backends
    # return. These follow that form; the cookbook logs whatever keys come (supervised/train.py).
    return {
        "grad_norm:mean": norm,
        "update_norm:mean": update,
        "param_norm:mean": param_norm,
        "learning_rate:mean": adam["learning_rate"],
        "clipped:sum": float(clipped),
    }


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all the tensors together, accumulated in fp32 on their device (no host sync)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))


def adapter_state_dict(loaded: model_loading.LoadedModel, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's own tensors (PEFT's names, on the host). Without PEFT's embedding layers: with the LM head a
    target (``train_unembed``) its "auto" would add the frozen base head, [vocab, hidden], to every sampler
    snapshot and artifact (hundreds of MB on a 150k vocabulary) for values the base already holds."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(loaded.model, adapter_name=adapter, save_embedding_layers=False)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def _base_weights(state: dict[str, torch.Tensor]) -> set[str]:
    """Keys of a saved state that are a wrapped layer's base weight (PEFT's saved embedding layers: artifacts of
    runs with ``train_unembed`` saved before :func:`adapter_state_dict` left them out)."""
    return {k for k in state if k.endswith(".base_layer.weight")}


def load_adapter_state(
    loaded: model_loading.LoadedModel, adapter: str, state: dict[str, torch.Tensor]
) -> None:
    from peft import set_peft_model_state_dict

    mine = adapter_state_dict(loaded, adapter)
    dropped = _base_weights(state)
    state = {k: v for k, v in state.items() if k not in dropped}
    if set(mine) != set(state) or any(mine[k].shape != state[k].shape for k in mine):
        raise FailedPrecondition(
            "the saved adapter's tensors do not match the run's (rank or target modules differ): "
            f"{len(state)} saved, {len(mine)} in the run"
        )
    with torch.no_grad():
        set_peft_model_state_dict(loaded.model, state, adapter_name=adapter)


def write_adapter(loaded: model_loading.LoadedModel, adapter: str, out_dir: Path, *, rank: int) -> None:
    """A PEFT adapter directory of the run (what ``SaveAdapter`` writes for a session's adapter: weights,
    config, the base's tokenizer files, its NF4 statistics and base record), so export_svc exports it like any
    adapter."""
    from safetensors.torch import save_file

    save_file(adapter_state_dict(loaded, adapter), str(out_dir / "adapter_model.safetensors"))
    cfg = loaded.model.peft_config[adapter]
    cfg.save_pretrained(str(out_dir))
    model_loading.copy_tokenizer_files(loaded.model_dir, out_dir)
    if loaded.facts.quantization == "bnb-nf4-on-load":
        model_loading.write_nf4_stats(loaded.model, out_dir / model_loading.NF4_STATS_FILE)
    model_loading.write_base_record(out_dir, adapter_base_metadata(loaded, rank))


def adapter_base_metadata(loaded: model_loading.LoadedModel, rank: int) -> dict[str, str]:
    return {**model_loading.adapter_metadata(loaded), "r": str(rank)}


def optimizer_tensors(opt: torch.optim.AdamW, names: list[str]) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    out = {}
    for i, name in enumerate(names):
        for key, value in sd["state"].get(i, {}).items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{name}::{key}"] = t.detach().to("cpu", copy=True).contiguous()
    return out


def load_optimizer_tensors(
    opt: torch.optim.AdamW, names: list[str], tensors: dict[str, torch.Tensor]
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(names):
        entry = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
        if entry:
            state[i] = entry
    unknown = {k.split("::", 1)[0] for k in tensors} - set(names)
    if unknown:
        raise FailedPrecondition(
            f"the saved optimizer state names parameters the run lacks: {sorted(unknown)[:3]}"
        )
    sd = opt.state_dict()
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def write_state(out_dir: Path, meta: dict, opt_tensors: dict[str, torch.Tensor] | None) -> None:
    from safetensors.torch import save_file

    (out_dir / STATE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    if opt_tensors is not None:
        save_file(opt_tensors, str(out_dir / OPTIMIZER_FILE))


def read_state(state_dir: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(run_state.json, adapter tensors, optimizer tensors or None) of a SaveState artifact (safetensors only)."""
    from safetensors.torch import load_file

    meta_path = state_dir / STATE_FILE
    if not meta_path.is_file():
        raise FailedPrecondition("the artifact is not a training-run state (it has no run_state.json)")
    meta = json.loads(meta_path.read_text())
    adapter = load_file(str(state_dir / "adapter_model.safetensors"))
    opt_path = state_dir / OPTIMIZER_FILE
    return meta, adapter, (load_file(str(opt_path)) if opt_path.is_file() else None)
