"""GRPO as a trainer job: a loop on the session's one model over the step API's pieces (docs/grpo.md).

Each step takes ``batch_size`` prompts (a seeded permutation per epoch), samples ``group_size`` completions of each
with the step API's sampler (``sampler.sample``: the base loaded once, the job's LoRA active, so the weights being
trained sample), grades them with the job's declarative grader (``strop.graders``), turns the rewards into group
advantages, and runs ``num_iterations`` AdamW updates of GRPO's loss (``kernels/losses/grpo.py``) over the chunked
log-prob engine (never the full logits): one prompt's group per forward/backward, gradients summed over the step.

Old-policy log-probs: the first update of a batch computes the learner's own log-probs with the weights that sampled
(``old = lp`` detached; ratios are exactly 1 in value), kept for the later updates; the sampler's log-probs enter
through truncated importance sampling (``tis_cap``): the same weights computed by the decode path and by training
differ in numerics, and the correction weighs each token by ``min(exp(old − sampler), cap)``. With ``kl_coef`` > 0
the reference is the same base with the adapter disabled (one no-grad pass per group, chunked as well).

Exact resume: a step's prompts, sampling seeds (one per prompt: ``seed``, step, prompt) and torch's global seed
(dropout) depend only on the job's seed and the step, and a checkpoint holds the adapter, AdamW's state and the
update count (the scheduler is replayed to it), so a resumed job takes the same steps as one never stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import resource
import shutil
import time
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    GRPO_DEFAULTS,
    DatasetFormat,
    GraderMetrics,
    GrpoConfig,
    RlMetrics,
    StepMetrics,
    TrainConfig,
)
from strop.kernels.losses.grpo import group_advantages, grpo_loss, token_entropy_rows
from strop.kernels.losses.logps import token_logps_rows, token_logps_trainable_head
from strop.trainer_svc.core import grader_sessions, shared_prefix, step_ops
from strop.trainer_svc.core.chat_sampling import eos_ids, prompt_ids, reply_text
from strop.trainer_svc.core.evaluation import ValidationSet
from strop.trainer_svc.core.guard import BrokenTraining, names
from strop.trainer_svc.core.model_loading import LoadedModel, drop_inference_weights, repacked_4bit_layers
from strop.trainer_svc.core.sampler import SampleRequest, SamplingParams, sample
from strop.trainer_svc.core.training import JobControl, Sinks

log = logging.getLogger("strop.trainer")

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")  # the loop's AdamW (step_ops.new_optimizer)
ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}  # HF TrainingArguments' defaults, as the other jobs train
# A group whose advantages are all 0 (every sample scored alike) adds exactly 0 to the loss and the gradient when
# kl_coef is 0: it is not run (DAPO's dynamic sampling drops such groups too), and a step with no other group makes
# no update (AdamW would move the adapter on its momentum alone: in tests/trainer_svc/test_grpo.py's task, seeds 0-8
# at lr 1e-2, that undid the solved task in 7 of 18 runs on the step after a perfect one). bench/grpo_bench.py turns it off to train every group, as TRL does.
SKIP_GROUPS_WITHOUT_SIGNAL = True
# Train a group as one row with its prompt computed once (shared_prefix.py) where the model's attention allows; off:
# padded rows, the prompt once per sample (the same loss and gradients up to rounding; tests compare the two)
SHARED_PREFIX = True


# ---- the job's settings, checked before anything runs -------------------------------------------------------


def grpo_with_defaults(cfg: TrainConfig) -> GrpoConfig:
    """``cfg.grpo`` with ``GRPO_DEFAULTS`` for its zero fields, every value checked (InvalidArgument naming the
    field); the grader is parsed by :func:`check_job`, against the dataset."""
    g = cfg.grpo
    if g is None:
        raise InvalidArgument("config.grpo is required for GRPO (its grader at least)")
    for f in fields(g):
        value = getattr(g, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"config.grpo.{f.name} must be a finite number, got {value}")
    fill = {}
    for name, default in GRPO_DEFAULTS.items():
        value = getattr(g, name)
        if not value or getattr(value, "name", "") == "UNSPECIFIED":
            fill[name] = type(value)(default)
    g = replace(g, **fill)
    checks = [
        ("grader", bool(g.grader.strip()), "is required (the OpenAI grader object, as JSON)"),
        (
            "group_size",
            g.group_size >= 2,
            f"must be >= 2 (advantages compare a prompt's samples), got {g.group_size}",
        ),
        ("group_size", g.group_size <= 1024, f"must be <= 1024, got {g.group_size}"),
        ("max_new_tokens", g.max_new_tokens >= 1, f"must be >= 1, got {g.max_new_tokens}"),
        ("temperature", g.temperature > 0, f"must be > 0, got {g.temperature}"),
        ("top_p", 0 < g.top_p <= 1, f"must be in (0, 1], got {g.top_p}"),
        ("kl_coef", g.kl_coef >= 0, f"must be >= 0, got {g.kl_coef}"),
        ("clip_eps_low", 0 < g.clip_eps_low < 1, f"must be in (0, 1), got {g.clip_eps_low}"),
        ("clip_eps_high", g.clip_eps_high > 0, f"must be > 0, got {g.clip_eps_high}"),
        ("tis_cap", g.tis_cap < 0 or g.tis_cap >= 1, f"must be >= 1 (negative: off), got {g.tis_cap}"),
        ("num_iterations", 1 <= g.num_iterations <= 64, f"must be in 1..64, got {g.num_iterations}"),
    ]
    for name, ok, message in checks:
        if not ok:
            raise InvalidArgument(f"config.grpo.{name} {message}")
    if cfg.optimizer not in OPTIMIZERS:
        raise InvalidArgument(
            f"config: optimizer {cfg.optimizer!r}: GRPO trains with AdamW, one of {OPTIMIZERS}"
        )
    if cfg.gradient_accumulation_steps != 1:
        raise InvalidArgument(
            "config: gradient_accumulation_steps: a GRPO step sums the gradients of all its prompts' groups before "
            "each update; set batch_size (prompts per step) instead"
        )
    if cfg.ranks() > 1:
        raise InvalidArgument(
            f"config: num_devices {cfg.num_devices}: GRPO runs in the session's own process"
        )
    return g


def parse_grader(grader_json: str, model_fn=None):
    """The job's grader (``strop.graders``), a bad spec InvalidArgument naming its field under ``config.grpo``;
    ``model_fn`` answers its model graders (``grader_sessions.GraderSessions``)."""
    from strop.graders import GraderSpecError
    from strop.graders import parse_grader as parse

    try:
        spec = json.loads(grader_json)
    except ValueError as exc:
        raise InvalidArgument(f"config.grpo.grader is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("config.grpo.grader is not valid JSON: nested too deeply") from None
    try:
        return parse(spec, model_fn=model_fn)
    except GraderSpecError as exc:
        raise InvalidArgument(f"config.grpo.{exc.field}: {exc.message}") from None


def grader_models(cfg: TrainConfig, sessions, session) -> dict:
    """The sessions answering the job's model graders (``grader_sessions.resolve``: INVALID_ARGUMENT naming the
    field for a model no open session serves), resolved for the caller when the job is submitted or resumed."""
    grader = parse_grader(cfg.grpo.grader)
    if not grader.models:
        return {}
    return grader_sessions.resolve(grader, sessions, session)


def check_job(
    cfg: TrainConfig,
    fmt: DatasetFormat,
    rows: list[dict],
    tokenizer,
    *,
    validation: ValidationSet | None = None,
) -> TrainConfig:
    """``cfg`` with GRPO's defaults filled in, after every check that needs no sampling: the settings, the grader
    spec, every row (training and validation) against the grader's templates, and each prompt's length plus
    ``max_new_tokens`` against ``max_length``. InvalidArgument names the field (or the row)."""
    g = grpo_with_defaults(cfg)
    if fmt is not DatasetFormat.PROMPTS:
        raise InvalidArgument(
            f"GRPO needs prompts rows (messages ending with the user's turn, plus the fields the grader reads); "
            f"the dataset is {fmt.value.lower()}"
        )
    if cfg.keep_best_checkpoint:
        raise InvalidArgument(
            "config: keep_best_checkpoint picks the least valid_loss; a GRPO job evaluates a mean reward "
            "(RlMetrics.eval_reward_mean), so it keeps its last adapter"
        )
    grader = parse_grader(g.grader)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("GRPO renders prompts with the chat template; this model's tokenizer has none")
    _check_rows(grader, g, cfg, rows, tokenizer, "dataset")
    if validation is not None:
        _check_rows(grader, g, cfg, validation.rows, tokenizer, "validation set")
    return replace(cfg, grpo=g)


def _check_rows(grader, g: GrpoConfig, cfg: TrainConfig, rows: list[dict], tokenizer, what: str) -> None:
    from strop.graders import check_row

    for i, row in enumerate(rows, 1):
        missing = check_row(grader, row)
        if missing is not None:
            raise InvalidArgument(
                f"config.grpo.{missing.field}: {missing.message} ({what} row {i} has no such field)"
            )
        n = len(prompt_ids(tokenizer, row["messages"]))
        if n + g.max_new_tokens > cfg.max_length:
            raise InvalidArgument(
                f"{what} row {i}: its prompt is {n} tokens, plus max_new_tokens {g.max_new_tokens} exceeds "
                f"max_length {cfg.max_length}"
            )


# ---- the loop ---------------------------------------------------------------------------------------------


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:7], "little")


def eval_seed(seed: int, i: int) -> int:
    """The sampling seed of held-out prompt ``i`` at every evaluation of a job seeded ``seed``."""
    return _seed(seed, "eval", i)


def step_prompts(num_rows: int, batch: int, seed: int, step: int) -> list[int]:
    """Row indices of step ``step`` (0-based): consecutive slices of one seeded permutation per epoch."""
    out = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(_seed(seed, "epoch", epoch)))
        out.append(int(perm[pos]))
    return out


def _peak_memory(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class _Group:
    """One prompt's sampled group, as the loss reads it."""

    # padded: prompt + completion minus its last token, a row per sample; shared prefix: one row (shared_prefix.py)
    batch: step_ops.Batch
    # padded: [real positions] bool, the positions that predict a completion token; shared prefix: [M] the row
    # positions that do, sample by sample
    scored: torch.Tensor
    targets: torch.Tensor  # [M] completion tokens, sample by sample
    # per token: sampler_logps, advantages, seq_index (later old_logps, ref_logps, trainer_logps)
    inputs: dict[str, torch.Tensor]
    tokens: int  # prompt + completion tokens of the group's sequences
    positions: torch.Tensor | None = None  # shared prefix: [1, L] the row's position ids
    layout: shared_prefix.Layout | None = None


def _group(prompt: list[int], seqs, adv: torch.Tensor, device: str, shared: bool) -> _Group:
    positions = lay = None
    if shared:
        tokens, positions, lay = shared_prefix.inputs(prompt, [s.tokens[:-1] for s in seqs], device)
        batch = step_ops.Batch(tokens, torch.ones_like(tokens), [lay.width])
        scored = shared_prefix.predicting_rows(lay, [len(s.tokens) for s in seqs], device)
    else:
        full = [prompt + s.tokens for s in seqs]
        batch = _batch(full, device)
        scored = torch.cat([torch.arange(len(f) - 1) >= len(prompt) - 1 for f in full]).to(device)
    lengths = torch.tensor([len(s.tokens) for s in seqs])
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    inputs = {
        "sampler_logps": torch.tensor([x for s in seqs for x in s.logprobs], dtype=torch.float32),
        "advantages": adv.float()[seq_index],
        "seq_index": seq_index,
    }
    targets = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.long)
    n = len(prompt) * len(seqs) + int(lengths.sum())
    return _Group(
        batch, scored, targets.to(device), {k: v.to(device) for k, v in inputs.items()}, n, positions, lay
    )


def _batch(full: list[list[int]], device: str) -> step_ops.Batch:
    inputs = [f[:-1] for f in full]
    width = max(len(t) for t in inputs)
    tokens = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros(len(inputs), width, dtype=torch.long)
    for i, t in enumerate(inputs):
        tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, : len(t)] = 1
    return step_ops.Batch(tokens.to(device), mask.to(device), [len(t) for t in inputs])


def _model_fn(graders: dict | None):
    if not graders:
        return None
    return grader_sessions.GraderSessions(graders)


class GrpoLoop:
    """One GRPO job's state on a session: its prompts, grader, optimizer and scheduler."""

    def __init__(
        self,
        loaded: LoadedModel,
        rows: list[dict],
        cfg: TrainConfig,
        eval_rows: list[dict] | None,
        graders: dict | None = None,
    ):
        self.loaded, self.rows, self.cfg, self.g = loaded, rows, cfg, cfg.grpo
        self.grader = parse_grader(self.g.grader, _model_fn(graders))
        tok = loaded.tokenizer
        self.prompts = [prompt_ids(tok, r["messages"]) for r in rows]
        self.eval_rows = eval_rows or []
        self.eval_prompts = [prompt_ids(tok, r["messages"]) for r in self.eval_rows]
        model = loaded.model
        self.adapter = model.active_adapter
        self.named = step_ops.run_params(loaded, self.adapter)
        self.params = [p for _, p in self.named]
        steps_per_epoch = math.ceil(len(rows) / cfg.batch_size)
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * steps_per_epoch)
        self.total_updates = self.total_steps * self.g.num_iterations
        self.opt = step_ops.new_optimizer(
            self.params, {**ADAM, "learning_rate": cfg.learning_rate, "weight_decay": cfg.weight_decay}
        )
        from transformers import get_scheduler

        warmup = cfg.warmup_steps * self.g.num_iterations or math.ceil(cfg.warmup_ratio * self.total_updates)
        self.sched = get_scheduler(cfg.lr_scheduler, self.opt, warmup, self.total_updates)
        self.updates = 0
        self.tokens_seen = 0
        base = model.get_base_model()
        self.softcap = getattr(base.config, "final_logit_softcapping", None)
        head = base.lm_head
        layer = getattr(head, "base_layer", head)
        self.weight, self.bias = layer.weight, getattr(layer, "bias", None)
        self.head = head if hasattr(head, "lora_A") and self.adapter in head.lora_A else None
        self.eos = eos_ids(loaded)
        # a group trains as one row with its prompt once where the attention allows (shared_prefix.py)
        why = shared_prefix.reason(model) if SHARED_PREFIX else "turned off"
        self.shared = why is None
        if why is not None:
            log.info("GRPO trains each group as padded rows (the prompt once per sample): %s", why)

    # -- state ---------------------------------------------------------------------------------------------

    def save(self, step: int, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(
            step_ops.adapter_state_dict(self.loaded, self.adapter), str(out_dir / "adapter_model.safetensors")
        )
        self.loaded.model.peft_config[self.adapter].save_pretrained(str(out_dir))
        opt = step_ops.optimizer_tensors(self.opt, [n for n, _ in self.named])
        meta = {"grpo_step": step, "updates": self.updates, "tokens_seen": self.tokens_seen}
        step_ops.write_state(out_dir, meta, opt)

    def load(self, ckpt: Path) -> int:
        meta, adapter, opt = step_ops.read_state(ckpt)
        if "grpo_step" not in meta:
            raise InvalidArgument("the checkpoint to resume from is not a GRPO job's")
        step_ops.load_adapter_state(self.loaded, self.adapter, adapter)
        if opt is not None:
            step_ops.load_optimizer_tensors(self.opt, [n for n, _ in self.named], opt)
        with warnings.catch_warnings():  # replaying the schedule before any optimizer step is the point
            warnings.simplefilter("ignore")
            for _ in range(int(meta["updates"])):
                self.sched.step()
        self.updates = int(meta["updates"])
        self.tokens_seen = int(meta.get("tokens_seen", 0))
        return int(meta["grpo_step"])

    # -- sampling and grading ------------------------------------------------------------------------------

    def _sample(self, prompts: list[list[int]], n: int, seeds: list[int]):
        g = self.g
        reqs = [
            SampleRequest(
                p,
                n,
                SamplingParams(max_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, seed=s),
            )
            for p, s in zip(prompts, seeds, strict=True)
        ]
        out = sample(
            self.loaded.model,
            reqs,
            tokenizer=self.loaded.tokenizer,
            eos_token_ids=self.eos,
            max_length=self.cfg.max_length,
        )
        packed = repacked_4bit_layers(self.loaded.model)
        if packed:  # bitsandbytes' CPU inference layout has no backward (DESIGN.md, facts)
            raise BrokenTraining(
                f"sampling left {len(packed)} 4-bit layers in an inference layout: {names(packed)}"
            )
        return out

    def _grade(self, results, items: list[dict]) -> tuple[torch.Tensor, list]:
        from strop.graders import Sample

        tok = self.loaded.tokenizer
        samples, row_items = [], []
        for res, item in zip(results, items, strict=True):
            for s in res.sequences:
                samples.append(Sample.of(reply_text(tok, s, self.eos), num_tokens=len(s.tokens)))
                row_items.append(item)
        grades = self.grader.grade_many(samples, row_items)
        return torch.tensor([gr.score for gr in grades], dtype=torch.float32), grades

    @staticmethod
    def _grader_metrics(grades) -> list[GraderMetrics]:
        out = []
        for name in grades[0].per_grader if grades else []:
            scores = [gr.per_grader[name] for gr in grades]
            passed = [bool(gr.passed.get(name, False)) for gr in grades]
            out.append(GraderMetrics(name, sum(scores) / len(scores), sum(passed) / len(passed)))
        return out

    def evaluate(self) -> tuple[float, list[GraderMetrics]]:
        """Mean reward of one sample per held-out prompt, each with its own fixed seed (the same at every eval, so
        evaluations differ by the weights only)."""
        seeds = [eval_seed(self.cfg.seed, i) for i in range(len(self.eval_prompts))]
        per_call = self.cfg.batch_size * self.g.group_size  # as many rows as a training step samples
        results = []
        for i in range(0, len(seeds), per_call):
            results += self._sample(self.eval_prompts[i : i + per_call], 1, seeds[i : i + per_call])
        rewards, grades = self._grade(results, self.eval_rows)
        return float(rewards.mean()), self._grader_metrics(grades)

    # -- one step ------------------------------------------------------------------------------------------

    def _logps(self, rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / temperature)[target], chunked: the rows scaled instead of the logits (the same
        product; a soft-cap then applies to the scaled logits)."""
        if self.head is not None:
            head = self.head if temperature == 1.0 else (lambda h: self.head(h) / temperature)
            return token_logps_trainable_head(rows, head, targets, softcap=self.softcap)
        bias = self.bias
        if temperature != 1.0:
            rows = rows / temperature
            bias = None if bias is None else bias / temperature
        return token_logps_rows(rows, self.weight, targets, bias, softcap=self.softcap)

    @torch.no_grad()
    def _first_pass(self, grp: _Group, rows: torch.Tensor, sums: dict) -> None:
        """What the first update of a batch adds: the policy's entropy, and (truncated IS at a temperature other
        than 1) the trainer's raw log-probs, which the sampler's raw ones are compared with."""
        t = self.g.temperature
        bias = None if self.bias is None else self.bias / t
        sums["entropy"] += float(token_entropy_rows(rows / t, self.weight, bias, softcap=self.softcap).sum())
        if self.g.tis_cap >= 0 and t != 1.0:
            grp.inputs["trainer_logps"] = self._logps(rows, grp.targets)

    def _rows(self, grp: _Group) -> torch.Tensor:
        if grp.layout is None:
            return step_ops.hidden_rows(self.loaded, grp.batch)[grp.scored]
        backbone = self.loaded.model.get_base_model().model
        out = backbone(input_ids=grp.batch.tokens, position_ids=grp.positions, use_cache=False)
        return out.last_hidden_state[0].index_select(0, grp.scored)

    def _layout(self, grp: _Group):
        """The group's attention, around its forward and backward (the recompute of checkpointed layers)."""
        if grp.layout is None:
            return contextlib.nullcontext()
        return shared_prefix.active(self.loaded.model, grp.layout)

    def step(self, step: int) -> StepMetrics:
        cfg, g, loaded = self.cfg, self.g, self.loaded
        t0 = time.perf_counter()
        torch.manual_seed(_seed(cfg.seed, "step", step))  # dropout, if the adapter has any
        idx = step_prompts(len(self.prompts), cfg.batch_size, cfg.seed, step)
        prompts = [self.prompts[i] for i in idx]
        results = self._sample(prompts, g.group_size, [_seed(cfg.seed, step, i) for i in idx])
        t_sampled = time.perf_counter()
        rewards, grades = self._grade(results, [self.rows[i] for i in idx])
        rewards = rewards.view(len(idx), g.group_size)
        adv = group_advantages(rewards, scale=g.loss_type.value != "DR_GRPO")
        groups = [
            _group(p, r.sequences, a, loaded.device, self.shared)
            for p, r, a in zip(prompts, results, adv, strict=True)
        ]
        lengths = [len(s.tokens) for r in results for s in r.sequences]
        loss_cfg = {
            "loss_type": g.loss_type.value,
            "clip_eps_low": g.clip_eps_low,
            "clip_eps_high": g.clip_eps_high,
            "kl_coef": g.kl_coef,
            "tis_cap": g.tis_cap,
            "sequence_ratio": g.sequence_ratio,
            "num_seqs": len(lengths),
            "num_tokens": sum(lengths),
            "max_new_tokens": g.max_new_tokens,
        }
        keep = [not SKIP_GROUPS_WITHOUT_SIGNAL or g.kl_coef > 0 or bool((a != 0).any()) for a in adv]
        groups = [grp for grp, k in zip(groups, keep, strict=True) if k]
        if g.kl_coef > 0:  # the reference: the same base with the adapter disabled, no gradient
            with torch.no_grad(), loaded.model.disable_adapter(), loaded.compute_autocast():
                for grp in groups:
                    with self._layout(grp):
                        ref_rows = self._rows(grp)
                    grp.inputs["ref_logps"] = self._logps(ref_rows, grp.targets, g.temperature)
        sums = {"clipped": 0.0, "kl": 0.0, "tis": 0.0, "entropy": 0.0}
        first_loss, opt_metrics = (
            0.0,
            {"learning_rate:mean": self.sched.get_last_lr()[0], "grad_norm:mean": 0.0},
        )
        loaded.model.train()
        for it in range(g.num_iterations if groups else 0):
            total = 0.0
            for grp in groups:
                with step_ops.memory_mode(loaded, grp.batch), self._layout(grp):
                    with loaded.compute_autocast():
                        rows = self._rows(grp)
                        if it == 0:
                            self._first_pass(grp, rows.detach(), sums)
                        loss, lp, stats = grpo_loss(
                            rows,
                            self.weight,
                            grp.targets,
                            grp.inputs,
                            loss_cfg,
                            bias=self.bias,
                            softcap=self.softcap,
                            logps=lambda r, t: self._logps(r, t, g.temperature),
                        )
                    loss.backward()
                if it == 0:  # the weights that sampled: the later updates' old policy
                    grp.inputs["old_logps"] = lp.detach()
                total += float(loss.detach())
                for k in ("clipped", "kl", "tis"):
                    sums[k] += float(stats[k])
            if it == 0:
                first_loss = total
            lr = self.sched.get_last_lr()[0]
            adam = {
                **ADAM,
                "learning_rate": lr,
                "weight_decay": cfg.weight_decay,
                "grad_clip_norm": cfg.max_grad_norm,
            }
            opt_metrics = step_ops.optim_step(self.opt, self.params, adam)
            self.sched.step()
            self.updates += 1
        if not groups:  # nothing to learn from this batch: no update, the schedule still advances
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(g.num_iterations):
                    self.sched.step()
            self.updates += g.num_iterations
        loaded.model.train(False)
        t_end = time.perf_counter()
        n_tok = sum(lengths)
        trained = sum(len(p) * g.group_size for p in prompts) + n_tok
        self.tokens_seen += trained
        # per token of the groups that trained
        n_run = max(sum(len(grp.targets) for grp in groups) * g.num_iterations, 1)
        run_tok = sum(grp.tokens for grp in groups)  # prompt + completion
        std = rewards.std(dim=1)
        rl = RlMetrics(
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.flatten().std()) if rewards.numel() > 1 else 0.0,
            graders=self._grader_metrics(grades),
            kl=sums["kl"] / n_run,
            clip_fraction=sums["clipped"] / n_run,
            entropy=sums["entropy"] / max(sum(len(grp.targets) for grp in groups), 1),
            sampled_length_mean=n_tok / len(lengths),
            sampled_length_max=max(lengths),
            sampling_tokens_per_second=n_tok / max(t_sampled - t0, 1e-9),
            training_tokens_per_second=run_tok * g.num_iterations / max(t_end - t_sampled, 1e-9),
            sampling_seconds=t_sampled - t0,
            training_seconds=t_end - t_sampled,
            tis_weight_mean=sums["tis"] / n_run if groups else 1.0,
            zero_std_groups=float((std == 0).float().mean()),
        )
        return StepMetrics(
            step=step + 1,
            total_steps=self.total_steps,
            epoch=(step + 1) * cfg.batch_size / len(self.prompts),
            loss=first_loss,
            learning_rate=float(opt_metrics["learning_rate:mean"]),
            grad_norm=float(opt_metrics["grad_norm:mean"]),
            tokens_per_second=trained / max(t_end - t0, 1e-9),
            tokens_seen=self.tokens_seen,
            peak_memory_bytes=_peak_memory(loaded.device),
            step_seconds=t_end - t0,
            rl=rl,
        )


def run_grpo(
    loaded: LoadedModel,
    rows: list[dict],
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
    resume_from: Path | None = None,
    validation: ValidationSet | None = None,
    graders: dict | None = None,
) -> int:
    """Train to completion or until stopped (a checkpoint at the step reached); returns that step. With a
    validation set, its prompts' mean reward (the first ``eval_rows`` of them when set) joins the step metrics every
    ``eval_every_steps`` steps and at the last step. ``graders`` (``grader_models``) answers model graders."""
    eval_rows = None if validation is None else validation.rows[: cfg.eval_rows or None]
    eval_every_steps = cfg.eval_every_steps
    work_dir.mkdir(parents=True, exist_ok=True)
    drop_inference_weights(loaded)
    if loaded.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(loaded.device)
    loop = GrpoLoop(loaded, rows, cfg, eval_rows, graders)
    step = loop.load(resume_from) if resume_from is not None else 0
    # on CUDA each layer is recomputed in backward, as the step API's runs and the jobs' memory mode assume
    # (step_ops.memory_mode sizes its offload for checkpointed layers); elsewhere as the config asks
    checkpointing = loaded.device.startswith("cuda") or cfg.gradient_checkpointing
    was_checkpointing = bool(getattr(loaded.model, "is_gradient_checkpointing", False))
    if checkpointing and not was_checkpointing:
        loaded.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sinks.on_start(loop.total_steps)

    def checkpoint(at: int) -> None:
        path = work_dir / f"checkpoint-{at}"
        loop.save(at, path)
        sinks.on_checkpoint(at, path)
        shutil.rmtree(path, ignore_errors=True)

    try:
        while step < loop.total_steps:
            # the step seeds torch's generator (dropout) for itself; the process's generator is put back after
            with torch.random.fork_rng(devices=[loaded.device] if loaded.device.startswith("cuda") else []):
                metrics = loop.step(step)
            step += 1
            at_eval = (eval_every_steps > 0 and step % eval_every_steps == 0) or step == loop.total_steps
            if loop.eval_prompts and at_eval:
                metrics.rl.eval_reward_mean, metrics.rl.eval_graders = loop.evaluate()
            sinks.on_step(metrics)
            if control.stop is not None or (
                cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0
            ):
                checkpoint(step)
            if control.stop is not None:
                break
        return step
    finally:
        if checkpointing and not was_checkpointing:
            loaded.model.gradient_checkpointing_disable()
        loaded.model.train(False)
        loop.opt.zero_grad(set_to_none=True)
        shutil.rmtree(work_dir, ignore_errors=True)
