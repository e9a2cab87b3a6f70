"""The ``strop`` command line: run the services, drive training jobs, export adapters.

A composition root over the SDK: ``strop serve trainer|export`` and ``strop export run --offline`` import the
service packages lazily, so ``strop train``, ``strop jobs`` and ``strop export`` against a service need only
grpcio and never import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strop.cli import export, runs
from strop.cli.options import DEFAULT_TRAINER, add_target, target_of
from strop.cli.output import print_json
from strop.client.errors import StropClientError
from strop.client.progress import follow
from strop.common.trainer_types import (
    ADAPTER_SCALE_AUTO,
    CHAT_RECIPE_ADAPTER_SCALE,
    CHAT_RECIPE_KL,
    CHAT_RECIPE_NEIGHBOURS,
    KL_RETENTION_WEIGHT,
    METHOD_DATASET_FORMAT,
    DatasetFormat,
    KernelMode,
    MemoryMode,
    Parallelism,
    TrainMethod,
    scale_text,
)


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] not in ("trainer", "export", "tinker", "openai"):
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(
            "usage: strop serve {trainer|export|tinker|openai} [options]\n\n"
            "Run the trainer (gRPC, GPU), the export service (gRPC, CPU), the Tinker REST gateway or the OpenAI\n"
            "fine-tuning gateway (HTTP, clients of the trainer) in this process. Every option, with its default and\n"
            "environment variable: strop serve trainer --help, strop serve export --help, strop serve tinker --help,\n"
            "strop serve openai --help.",
            file=sys.stdout if asked else sys.stderr,
        )
        return 0 if asked else 2
    if argv[0] == "trainer":
        from strop.trainer_svc.server import main
    elif argv[0] == "tinker":
        from strop.gateways.tinker.server import main
    elif argv[0] == "openai":
        from strop.gateways.openai.server import main
    else:
        from strop.export_svc.server import main
    main(argv[1:])
    return 0


def _adapter_scale(text: str) -> float:
    """--adapter-scale: a number, or "auto" (ADAPTER_SCALE_AUTO)."""
    if text.strip().lower() == "auto":
        return ADAPTER_SCALE_AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number in 0..1 or auto, not {text!r}") from None


def _default(name: str) -> str:
    """The trainer's default for a TrainConfig field, as --help shows it."""
    from strop.common.trainer_types import TRAIN_DEFAULTS

    value = TRAIN_DEFAULTS[name]
    if isinstance(value, dict):
        return ", ".join(f"{v:.0e} ({k})" if isinstance(v, float) else f"{v} ({k})" for k, v in value.items())
    return str(value).lower() if name == "memory_mode" else str(value)


def _add_train(sub) -> None:
    from strop.common.trainer_types import LoraConfig

    lora = LoraConfig()
    p = sub.add_parser(
        "train",
        help="load a model, attach LoRA, upload a dataset and run SFT, DPO, ORPO, KTO, SimPO or GRPO",
        description="Upload a JSONL dataset (the trainer checks every row, and that the method trains on its format), "
        "then load a model on the trainer, attach LoRA, train and follow the job. "
        "The session is closed when the command ends (success, failure or Ctrl-C) unless --keep-session. "
        "Unset options take the trainer's defaults, shown below.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_target(p, "trainer")
    p.add_argument("--model", required=True, help="model path under the service's model root")
    p.add_argument("--dataset", required=True, help="local JSONL file to upload")
    p.add_argument(
        "--method",
        choices=[m.value.lower() for m in TrainMethod if m is not TrainMethod.UNSPECIFIED],
        default="sft",
        help="orpo, simpo: preference rows (prompt/chosen/rejected), as dpo; kto: prompt/completion/label rows; "
        "grpo: prompts rows (messages ending with the user's turn + the fields --grader reads)",
    )
    _add_grpo(p)
    p.add_argument(
        "--quantization",
        choices=("auto", "nf4", "none"),
        default="auto",
        help="auto: a prequantized 4-bit checkpoint stays 4-bit and a 16-bit one is quantized to NF4 (double quant) "
        "on load, on every device, the CPU included; nf4: the same, said explicitly; none: keep a 16-bit checkpoint "
        "16-bit (plain LoRA; refused for a prequantized one)",
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "on", "off", "on_fp8", "on_fp8_dx"),
        default="auto",
        help="auto: strop's kernels on CUDA; on_fp8: with the frozen bases' GEMMs in FP8 (opt-in, inexact, bf16 on "
        "a GPU of compute capability >= 8.9); on_fp8_dx: only their backward dx GEMMs (the forward stays exact)",
    )
    p.add_argument("--r", type=int, default=lora.r, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=lora.alpha, help="LoRA alpha")
    p.add_argument("--dropout", type=float, default=lora.dropout, help="LoRA dropout")
    p.add_argument("--target-modules", default="", help="comma-separated; empty: all seven projections")
    p.add_argument(
        "--rslora", action="store_true", help="rank-stabilised LoRA: scale alpha/sqrt(r), not alpha/r"
    )
    p.add_argument("--lr", type=float, default=0.0, help=f"learning rate; 0: {_default('learning_rate')}")
    p.add_argument("--scheduler", default="", help=f"empty: {_default('lr_scheduler')}")
    p.add_argument("--warmup-ratio", type=float, default=0.0, help="share of the steps the lr warms up over")
    p.add_argument("--max-steps", type=int, default=0, help="> 0 overrides --epochs")
    p.add_argument("--epochs", type=float, default=0.0, help=f"0: {_default('num_epochs')}")
    p.add_argument("--batch-size", type=int, default=0, help=f"0: {_default('batch_size')}")
    p.add_argument("--grad-accum", type=int, default=0, help=f"0: {_default('gradient_accumulation_steps')}")
    p.add_argument("--max-length", type=int, default=0, help=f"0: {_default('max_length')}")
    p.add_argument("--packing", action="store_true", help="pack several rows into each sequence")
    p.add_argument(
        "--completion-only",
        action="store_true",
        help="loss on the last assistant message only (messages) or the completion (prompt/completion)",
    )
    p.add_argument(
        "--loss-on-all-tokens",
        action="store_true",
        help="SFT on messages or prompt/completion: loss on every token, prompts and system messages "
        "included (default: assistant messages only, as the OpenAI fine-tuning API)",
    )
    p.add_argument("--optimizer", default="", help=f"empty: {_default('optimizer')}")
    p.add_argument("--beta", type=float, default=0.0, help=f"DPO beta; 0: {_default('dpo_beta')}")
    p.add_argument("--dpo-loss", default="", help=f"empty: {_default('dpo_loss_type')}")
    p.add_argument(
        "--orpo-lambda", type=float, default=0.0, help=f"ORPO odds-ratio weight; 0: {_default('orpo_lambda')}"
    )
    p.add_argument("--kto-beta", type=float, default=0.0, help=f"0: {_default('kto_beta')}")
    p.add_argument(
        "--kto-desirable-weight", type=float, default=0.0, help=f"0: {_default('kto_desirable_weight')}"
    )
    p.add_argument(
        "--kto-undesirable-weight", type=float, default=0.0, help=f"0: {_default('kto_undesirable_weight')}"
    )
    p.add_argument("--simpo-beta", type=float, default=0.0, help=f"0: {_default('simpo_beta')}")
    p.add_argument(
        "--simpo-gamma", type=float, default=0.0, help=f"target margin / beta; 0: {_default('simpo_gamma')}"
    )
    p.add_argument(
        "--retention",
        choices=("auto", "none", "replay", "kl"),
        default="auto",
        help="SFT on messages data, so the model keeps what it knows: replay trains on the base model's own answers "
        "to general prompts; kl adds a KL(base || model) term on those answers instead, not training on them; "
        f"auto: {_default('retention')}; on chat data (a chat template, one device) auto is the chat recipe: kl "
        f"with --retention-kl {CHAT_RECIPE_KL:g}, --retention-neighbours {CHAT_RECIPE_NEIGHBOURS} and "
        f"--adapter-scale {scale_text(CHAT_RECIPE_ADAPTER_SCALE)} where those are left 0",
    )
    p.add_argument(
        "--retention-rows",
        type=int,
        default=0,
        help=f"replay, kl: the base's answers replayed or scored; 0: {_default('retention_rows')}",
    )
    p.add_argument(
        "--retention-kl",
        type=float,
        default=0.0,
        help="weight of the KL(base || model) term on the base's answers; 0: none with replay, "
        f"{KL_RETENTION_WEIGHT:g} with kl, {CHAT_RECIPE_KL:g} with auto",
    )
    p.add_argument(
        "--retention-neighbours",
        type=int,
        default=0,
        help="kl: for each distinct start of the dataset's questions, this many questions of that form the base "
        f"writes and answers, scored by the KL term too; 0: none with kl, {CHAT_RECIPE_NEIGHBOURS} with auto",
    )
    p.add_argument(
        "--adapter-scale",
        type=_adapter_scale,
        default=0.0,
        help="the final adapter interpolated toward the base: every LoRA B factor times this (0-1) once training "
        "ends; auto: of 0.9, 0.8, ..., 0.5 the last before the first at which the finished adapter reproduces the "
        "dataset's conversations less well than at 1, refined to 0.025 between the two (chat data, one device); "
        "1: as trained; "
        f"0: {scale_text(CHAT_RECIPE_ADAPTER_SCALE)} under the chat recipe (--retention auto), else 1",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: only at the end and on cancel")
    held = p.add_mutually_exclusive_group()
    held.add_argument(
        "--validation-file", default="", help="local JSONL of held-out rows (the dataset's format)"
    )
    held.add_argument(
        "--validation-dataset", default="", help="an uploaded dataset's id as the validation set"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate the validation set every N steps; 0: only at the end",
    )
    p.add_argument(
        "--eval-rows", type=int, default=0, help="rows each periodic eval covers; 0: the whole set"
    )
    p.add_argument("--eval-batch-size", type=int, default=0, help="0: --batch-size")
    p.add_argument(
        "--keep-best",
        action="store_true",
        help="the job's adapter is its checkpoint of least valid loss (needs --eval-every; checkpoints at evals)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward to save memory",
    )
    p.add_argument(
        "--memory-mode",
        default="",
        choices=[m.value.lower() for m in MemoryMode if m is not MemoryMode.UNSPECIFIED],
        help=f"empty: {_default('memory_mode')}",
    )
    p.add_argument(
        "--memory-budget-gib",
        type=float,
        default=0.0,
        help="max_speed: device memory the job may use; 0: 90%% of the device",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the LoRA init, the data order and dropout")
    p.add_argument(
        "--num-devices",
        type=int,
        default=0,
        help="devices of the trainer's node the job trains on (DDP through torchrun); 0 or 1: one",
    )
    p.add_argument(
        "--parallelism",
        default="ddp",
        choices=[m.value.lower() for m in Parallelism if m is not Parallelism.UNSPECIFIED],
        help="--num-devices > 1: ddp (a whole base a device) or fsdp (FSDP2: the base sharded, 16-bit or 4-bit)",
    )
    p.add_argument("--save-adapter", default="", help="also save the adapter under this artifact id")
    p.add_argument(
        "--keep-session",
        action="store_true",
        help="leave the session loaded on the trainer when the command ends (for Generate or another job)",
    )
    p.set_defaults(func=_cmd_train)


def _add_grpo(p) -> None:
    """GRPO's options (0 or empty: ``GRPO_DEFAULTS``; docs/grpo.md)."""
    from strop.common.trainer_types import GRPO_DEFAULTS as D

    g = p.add_argument_group("GRPO (--method grpo)")
    g.add_argument(
        "--grader", default="", help="JSON file holding the OpenAI grader object (string_check, multi...)"
    )
    g.add_argument("--group-size", type=int, default=0, help=f"completions per prompt; 0: {D['group_size']}")
    g.add_argument("--max-new-tokens", type=int, default=0, help=f"0: {D['max_new_tokens']}")
    g.add_argument("--temperature", type=float, default=0.0, help=f"0: {D['temperature']}")
    g.add_argument("--top-p", type=float, default=0.0, help=f"0: {D['top_p']}")
    g.add_argument(
        "--kl-coef", type=float, default=0.0, help="KL to the base (adapter disabled); 0: no reference"
    )
    g.add_argument("--clip-eps-low", type=float, default=0.0, help=f"0: {D['clip_eps_low']}")
    g.add_argument("--clip-eps-high", type=float, default=0.0, help=f"0: {D['clip_eps_high']} (DAPO: 0.28)")
    g.add_argument(
        "--grpo-loss", choices=("grpo", "dr_grpo", "dapo"), default="grpo", help="loss aggregation"
    )
    g.add_argument("--gspo", action="store_true", help="GSPO's sequence-level importance ratio")
    g.add_argument(
        "--tis-cap", type=float, default=0.0, help=f"truncated IS cap; 0: {D['tis_cap']}; < 0: off"
    )
    g.add_argument(
        "--num-iterations", type=int, default=0, help=f"updates per batch; 0: {D['num_iterations']}"
    )


def _grpo_config(a):
    """The GrpoConfig of ``--method grpo`` (None for other methods); the grader file read here."""
    from strop.common.trainer_types import GrpoConfig, GrpoLoss

    if a.method != "grpo":
        return None
    grader = Path(a.grader).read_text() if a.grader else ""
    return GrpoConfig(
        grader=grader,
        group_size=a.group_size,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        kl_coef=a.kl_coef,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        loss_type=GrpoLoss(a.grpo_loss.upper()),
        sequence_ratio=a.gspo,
        tis_cap=a.tis_cap,
        num_iterations=a.num_iterations,
    )


def _cmd_train(a) -> int:
    from strop.client.trainer import TrainerClient
    from strop.common.trainer_types import LoraConfig, Quantization, Retention, TrainConfig

    quant = {"auto": Quantization.UNSPECIFIED, "nf4": Quantization.NF4, "none": Quantization.NONE}[
        a.quantization
    ]
    targets = [t for t in a.target_modules.split(",") if t]
    config = TrainConfig(
        method=TrainMethod(a.method.upper()),
        learning_rate=a.lr,
        lr_scheduler=a.scheduler,
        warmup_ratio=a.warmup_ratio,
        max_steps=a.max_steps,
        num_epochs=a.epochs,
        batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        max_length=a.max_length,
        packing=a.packing,
        completion_only_loss=a.completion_only,
        loss_on_all_tokens=a.loss_on_all_tokens,
        optimizer=a.optimizer,
        dpo_beta=a.beta,
        dpo_loss_type=a.dpo_loss,
        orpo_lambda=a.orpo_lambda,
        kto_beta=a.kto_beta,
        kto_desirable_weight=a.kto_desirable_weight,
        kto_undesirable_weight=a.kto_undesirable_weight,
        simpo_beta=a.simpo_beta,
        simpo_gamma=a.simpo_gamma,
        checkpoint_every_steps=a.checkpoint_every,
        seed=a.seed,
        gradient_checkpointing=a.gradient_checkpointing,
        memory_mode=MemoryMode(a.memory_mode),
        memory_budget_gib=a.memory_budget_gib,
        num_devices=a.num_devices,
        parallelism=Parallelism(a.parallelism.upper()),
        retention=Retention(a.retention.upper() if a.retention != "auto" else "UNSPECIFIED"),
        retention_rows=a.retention_rows,
        retention_kl=a.retention_kl,
        retention_neighbours=a.retention_neighbours,
        adapter_scale=a.adapter_scale,
        eval_every_steps=a.eval_every,
        eval_rows=a.eval_rows,
        eval_batch_size=a.eval_batch_size,
        keep_best_checkpoint=a.keep_best,
    )
    if a.method == "grpo" and not a.grader:
        print("error: --method grpo needs --grader (a JSON file holding the grader object)", file=sys.stderr)
        return 2
    for path in (a.dataset, a.validation_file, a.grader):
        if path and not Path(path).is_file():
            print(f"error: {path!r} is not a file", file=sys.stderr)
            return 2
    with TrainerClient(target_of(a, DEFAULT_TRAINER)) as tc:
        # the dataset is uploaded (and validated by the trainer) before a model is loaded: a bad file costs seconds,
        # not a model load
        config.grpo = _grpo_config(a)
        ds = tc.upload_dataset(a.dataset)
        print(f"dataset {ds.dataset_id}: {ds.num_rows} {ds.format.value.lower()} rows", file=sys.stderr)
        problem = _dataset_mismatch(config.method, ds.format)
        held_out = a.validation_dataset
        if a.validation_file and not problem:
            held_out = tc.upload_dataset(
                a.validation_file
            ).dataset_id  # bad rows: the line named, before a load
            print(f"validation dataset {held_out}", file=sys.stderr)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        kernels = KernelMode.UNSPECIFIED if a.kernels == "auto" else KernelMode(a.kernels.upper())
        session = tc.load_model(a.model, quantization=quant, kernels=kernels)
        job_id = ""
        print(
            f"session {session.session_id}: {session.facts.architecture} {session.facts.quantization} "
            f"on {session.facts.device} ({session.facts.kernels_reason})",
            file=sys.stderr,
        )
        try:
            lora = LoraConfig(r=a.r, alpha=a.alpha, dropout=a.dropout, use_rslora=a.rslora, seed=a.seed)
            if targets:
                lora.target_modules = targets
            tc.attach_lora(session.session_id, lora)

            def remember(ev) -> None:
                nonlocal job_id
                job_id = ev.job_id

            events = tc.train(session.session_id, ds.dataset_id, config, validation_dataset_id=held_out)
            job = tc.get_job(follow(events, on_event=remember))
            if a.save_adapter:
                tc.save_adapter(session.session_id, a.save_adapter)
            print_json(job)
            return 0 if job.state.value == "SUCCEEDED" else 1
        except KeyboardInterrupt:
            if job_id:  # jobs outlive their streams: Ctrl-C stops this job too, keeping its adapter
                tc.cancel_job(job_id)
                tc.wait_job(job_id)
                print(f"job {job_id} cancelled", file=sys.stderr)
            raise
        finally:
            if a.keep_session:
                print(f"session {session.session_id} kept (strop sessions close to free it)", file=sys.stderr)
            else:
                _close_quietly(tc, session.session_id)


def _dataset_mismatch(method: TrainMethod, fmt: DatasetFormat) -> str:
    """Why ``method`` cannot train on a dataset of format ``fmt`` ("" when it can), from the one table of which
    format each method trains on (``METHOD_DATASET_FORMAT``; SFT trains on every other format)."""
    needs = METHOD_DATASET_FORMAT.get(method)
    if needs is not None and fmt is not needs:
        return f"{method.value} trains on {needs.value.lower()} rows; this dataset is {fmt.value.lower()}"
    if needs is None and fmt in set(METHOD_DATASET_FORMAT.values()):
        return f"{method.value} needs text, messages or prompt/completion rows; this dataset is {fmt.value.lower()}"
    return ""


def _close_quietly(tc, session_id: str) -> None:
    """Close the session this command opened; a failure to close is reported, never raised over the result."""
    try:
        tc.close_session(session_id)
        print(f"session {session_id} closed", file=sys.stderr)
    except StropClientError as exc:
        print(f"session {session_id} not closed ({exc.code}): {exc}", file=sys.stderr)


def _add_jobs(sub) -> None:
    p = sub.add_parser(
        "jobs",
        help="list, inspect, follow, cancel or plot training jobs",
        description="Training jobs on the trainer: list, get, watch, cancel, plot.",
    )
    add_target(p, "trainer")
    jsub = p.add_subparsers(dest="jobs_cmd", required=True, metavar="{list,get,watch,cancel,plot}")
    q = jsub.add_parser("list", help="one line per job: id, state, method, step, last loss, name")
    q.add_argument(
        "--session", default="", help="only the jobs of this session (default: every job you can see)"
    )
    add_target(q, "trainer")
    for name, what in (
        ("get", "the job as JSON: state, config, figures, checkpoints, adapter"),
        ("watch", "replay the job's events from --after-seq, then follow it live until it ends"),
        ("cancel", "cancel the job: it stops between steps and keeps its adapter as a checkpoint"),
    ):
        q = jsub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        q.add_argument("job_id", help="the job's id (strop jobs list)")
        if name == "watch":
            q.add_argument(
                "--after-seq", type=int, default=0, help="replay only the events numbered above this (0: all)"
            )
        add_target(q, "trainer")
    q = jsub.add_parser("plot", help="write the job's loss curve (PNG, stored when the job ends)")
    q.add_argument("job_id", help="the job's id (strop jobs list)")
    q.add_argument("-o", "--output", default="", help="PNG file to write (default <job_id>-loss.png)")
    add_target(q, "trainer")
    p.set_defaults(func=_cmd_jobs)


def _cmd_jobs(a) -> int:
    from strop.client.trainer import TrainerClient

    with TrainerClient(target_of(a, DEFAULT_TRAINER)) as tc:
        if a.jobs_cmd == "list":
            for j in tc.list_jobs(a.session):
                print(
                    f"{j.job_id}\t{j.state.value}\t{j.config.method.value}\tstep {j.step}/{j.total_steps}"
                    f"\tloss {j.last_loss:.4f}\t{j.name}"
                )
        elif a.jobs_cmd == "get":
            print_json(tc.get_job(a.job_id))
        elif a.jobs_cmd == "watch":
            follow(tc.watch_job(a.job_id, a.after_seq))
        elif a.jobs_cmd == "plot":
            from strop.cli.plot import fetch_loss_curve

            print(fetch_loss_curve(tc, a.job_id, a.output))
        else:
            print_json(tc.cancel_job(a.job_id))
    return 0


def _add_sessions(sub) -> None:
    p = sub.add_parser(
        "sessions", help="list or close trainer sessions", description="Sessions on the trainer: list, close."
    )
    add_target(p, "trainer")
    ssub = p.add_subparsers(dest="sessions_cmd", required=True, metavar="{list,close}")
    q = ssub.add_parser(
        "list", help="one line per session: id, state, model, quantization, kernels, busy job"
    )
    q.add_argument("--all", action="store_true", help="closed sessions too")
    add_target(q, "trainer")
    q = ssub.add_parser("close", help="close a session and free its device memory")
    q.add_argument("session_id", help="the session's id (strop sessions list)")
    add_target(q, "trainer")
    p.set_defaults(func=_cmd_sessions)


def _cmd_sessions(a) -> int:
    from strop.client.trainer import TrainerClient

    with TrainerClient(target_of(a, DEFAULT_TRAINER)) as tc:
        if a.sessions_cmd == "list":
            for s in tc.list_sessions(include_closed=a.all):
                print(
                    f"{s.session_id}\t{s.state.value}\t{s.facts.model_path}\t{s.facts.quantization}"
                    f"\tkernels={s.facts.kernels_enabled}\t{s.busy_job_id}"
                )
        else:
            print_json(tc.close_session(a.session_id))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strop", description="strop: LoRA/QLoRA fine-tuning as a service")
    add_target(parser)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{serve,train,jobs,sessions,runs,export}"
    )
    sub.add_parser(
        "serve", help="run a service: strop serve {trainer|export|tinker|openai} [options]", add_help=False
    )
    _add_train(sub)
    _add_jobs(sub)
    _add_sessions(sub)
    runs.register(sub)
    export.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except StropClientError as exc:
        print(f"error ({exc.code}): {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
