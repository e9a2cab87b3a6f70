"""Validation: a job's held-out set evaluated with the method's own loss, against references outside strop.

On the CPU the trainer runs unpatched HF + PEFT in fp32. SFT's and DPO's eval losses are checked against a forward
written here on a fresh HF + PEFT model holding the trained adapter (full logits, log_softmax: nothing of TRL's
or strop's loss code); ORPO's, KTO's and SimPO's against TRL's own ``evaluate()`` on such a model (one batch of
every row, so its mean of batch means is the row mean strop reports). Training with validation on is training
without it, bit for bit; the best checkpoint is the least valid loss; bad input gets its status.
"""

from __future__ import annotations

import csv
import io
import math
import random
import re
from dataclasses import replace

import pytest
import torch

from strop.common.errors import InvalidArgument, NotFound
from strop.common.trainer_types import (
    DatasetFormat,
    LoadModelRequest,
    LoraConfig,
    Quantization,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import job_config, model_loading, training, validation
from strop.trainer_svc.core.evaluation import ValidationSet

LORA = LoraConfig(r=8, alpha=16, seed=0)
MAX_LEN = 64
LR = 5e-3
# fp32 on both sides, the same weights; they differ in batching (padding under an attention mask), in the order of
# sums and in TRL's chunked log-softmax against a full one: a few fp32 roundings (eps 6e-8) per logit and per sum
# of at most ~200 terms, far below 1e-5 of a loss of order 1-10 (DESIGN.md's fp32 tolerance)
REL = 1e-5


def _token_rows(n: int, seed: int, vocab: int) -> list[dict]:
    """Pre-tokenized SFT rows of 8-24 tokens, the loss on the second half (completion_mask)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(8, 24)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        rows.append({"input_ids": ids, "completion_mask": [0] * (length // 2) + [1] * (length - length // 2)})
    return rows


def _pref_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["red", "blue", "owl", "tree", "seven", "stone", "river", "cloud", "ten", "green"]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [{"prompt": f"Q: {say(4)}?", "chosen": f" {say(3)}.", "rejected": f" {say(5)}."} for _ in range(n)]


def _kto_rows(n: int, seed: int) -> list[dict]:
    out = []
    for r in _pref_rows(n // 2, seed):
        out += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True}]
        out += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False}]
    return out


def _loaded(model_root):
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE),
        model_root=model_root,
        device="cpu",
    )
    model_loading.attach_lora(loaded, LORA)
    return loaded


def _train(model_root, tmp_path, method, fmt, rows, val_rows, *, kernels=False, **fields):
    """strop's job path (load, attach, with_defaults, run_training); the events each sink got. ``kernels``: forced on
    after loading, the job runs strop's losses inside the TRL trainer as a CUDA job does (test_methods.py)."""
    loaded = _loaded(model_root)
    loaded.facts.kernels_enabled = kernels
    base = dict(
        learning_rate=LR, lr_scheduler="constant", max_steps=4, batch_size=2, max_length=MAX_LEN, seed=0
    )
    cfg = job_config.with_defaults(TrainConfig(method=method, **{**base, **fields}), session_max_len=MAX_LEN)
    got = {"steps": [], "evals": [], "ckpts": []}
    sinks = training.Sinks(
        on_step=got["steps"].append,
        on_checkpoint=lambda step, path: got["ckpts"].append(step),
        on_start=lambda n: None,
        on_eval=got["evals"].append,
    )
    held_out = ValidationSet("ds-val", val_rows) if val_rows is not None else None
    training.run_training(
        loaded, rows, fmt, cfg, tmp_path / "work", training.JobControl(), sinks, validation=held_out
    )
    return loaded, cfg, got


def _reference_model(model_root, trained):
    """A fresh HF + PEFT model (fp32) holding ``trained``'s adapter values."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_root / "tiny-llama", dtype=torch.float32)
    peft = PeftLoraConfig(
        r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=list(LORA.target_modules)
    )
    model = get_peft_model(model, peft)
    set_peft_model_state_dict(model, get_peft_model_state_dict(trained.model))
    return model.eval()


def _token_logps(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for each t, from the full logits (fp32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], logits.argmax(-1)


def test_sft_valid_loss_is_the_token_mean_nll_of_a_plain_hf_peft_forward(model_root, tmp_path):
    vocab = 640
    train, held = _token_rows(8, 0, vocab), _token_rows(7, 1, vocab)
    loaded, _, got = _train(
        model_root,
        tmp_path,
        TrainMethod.SFT,
        DatasetFormat.TOKENS,
        train,
        held,
        eval_every_steps=2,
        eval_rows=3,
        eval_batch_size=3,
    )
    evals = got["evals"]
    # steps 2 and 4 on schedule; the last (step 4, the final step) also covers the whole set
    assert [(e.step, e.is_full) for e in evals] == [(2, False), (4, True)]
    ref = _reference_model(model_root, loaded)
    nll, hits, tokens = [], 0, 0
    for i, row in enumerate(held):
        logp, top1 = _token_logps(ref, row["input_ids"])
        mask = torch.tensor(row["completion_mask"][1:], dtype=torch.bool)
        nll.append((-logp[mask].sum().item(), i < 3))
        hits += int((top1[mask] == torch.tensor(row["input_ids"][1:])[mask]).sum())
        tokens += int(mask.sum())
    full = sum(v for v, _ in nll) / tokens
    sample_tokens = sum(sum(r["completion_mask"][1:]) for r in held[:3])
    sample = sum(v for v, s in nll if s) / sample_tokens
    last = evals[-1]
    assert last.full_valid_loss == pytest.approx(full, rel=REL)
    assert last.valid_loss == pytest.approx(sample, rel=REL)  # the first eval_rows rows, token mean
    assert (last.rows, last.tokens) == (7, tokens)
    # argmax ties within fp32 rounding could flip a token: at most one of them
    assert abs(last.full_valid_mean_token_accuracy - hits / tokens) <= 1 / tokens
    assert evals[0].valid_loss != last.valid_loss, "training moved the sample's loss"


def _dpo_reference(model, rows: list[dict], tokenizer, beta: float) -> float:
    """TRL's sigmoid DPO loss, row mean, written out: completion log-probs (the tokens after the prompt, EOS appended
    as TRL appends it), policy = adapter on, reference = adapter disabled."""

    def seq_logps(prompt: str, completion: str) -> float:
        p = tokenizer(prompt)["input_ids"]
        full = tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), len(p))
        logp, _ = _token_logps(model, full)
        return logp[start - 1 :].sum().item()

    losses = []
    for r in rows:
        pol = [seq_logps(r["prompt"], r[k]) for k in ("chosen", "rejected")]
        with model.disable_adapter():
            ref = [seq_logps(r["prompt"], r[k]) for k in ("chosen", "rejected")]
        margin = beta * ((pol[0] - ref[0]) - (pol[1] - ref[1]))
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(margin, dtype=torch.float64)).item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("kernels", [False, True], ids=["hf", "chunked"])
def test_dpo_valid_loss_is_the_dpo_loss_of_a_plain_hf_peft_forward_against_the_base(
    model_root, tmp_path, kernels
):
    train, held = _pref_rows(4, 0), _pref_rows(3, 1)
    loaded, cfg, got = _train(
        model_root,
        tmp_path,
        TrainMethod.DPO,
        DatasetFormat.PREFERENCE,
        train,
        held,
        max_steps=2,
        eval_batch_size=2,
        learning_rate=5e-2,
        kernels=kernels,
    )
    assert ("_strop_hidden_head" in loaded.model.get_base_model().__dict__) is kernels, (
        "strop's chunked DPO ran"
    )
    (last,) = got["evals"]  # eval_every_steps 0: once, at the end, over the whole set
    assert last.step == 2 and last.is_full and last.rows == 3
    ref = _dpo_reference(_reference_model(model_root, loaded), held, loaded.tokenizer, cfg.dpo_beta)
    # each of a pair's four sequence log-probs sums <= 30 fp32 terms of |logp| <= 10 (a few roundings each, eps 6e-8,
    # in another order when chunked): within 2.5e-5, so the margin within beta * 1e-4 and |d loss / d margin| <= 1
    assert last.valid_loss == pytest.approx(ref, abs=cfg.dpo_beta * 1e-4)
    assert last.valid_loss != pytest.approx(math.log(2), abs=1e-4), "a trained policy is off the reference"
    assert last.dpo is not None and 0.0 <= last.dpo.reward_accuracy <= 1.0


def _trl_eval_loss(model_root, loaded, method, rows, cfg) -> float:
    """TRL's own evaluate() on a fresh HF + PEFT model with the trained adapter, every row in one batch."""
    from datasets import Dataset

    model = _reference_model(model_root, loaded)
    cls, trl_cfg = training.trl_preference_config(
        cfg,
        dict(
            output_dir=str(loaded.model_dir.parent / "ref-eval"),
            per_device_eval_batch_size=len(rows),
            report_to="none",
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
        ),
    )
    kwargs = {"ref_model": None} if method is TrainMethod.KTO else {}
    trainer = cls(
        model=model,
        args=trl_cfg,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=loaded.tokenizer,
        **kwargs,
    )
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    # KTO snapshots the adapter; strop's reference is the base (as the job's)
    if "ref" in peft_model.peft_config:
        peft_model.delete_adapter("ref")
        peft_model.set_adapter("default")
    return trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("method", [TrainMethod.ORPO, TrainMethod.KTO, TrainMethod.SIMPO], ids=str.lower)
def test_preference_methods_valid_loss_is_trls_own_eval_loss_on_those_rows(model_root, tmp_path, method):
    fmt = DatasetFormat.UNPAIRED_PREFERENCE if method is TrainMethod.KTO else DatasetFormat.PREFERENCE
    make = _kto_rows if method is TrainMethod.KTO else _pref_rows
    train, held = make(6, 0), make(4, 1)
    loaded, cfg, got = _train(
        model_root, tmp_path, method, fmt, train, held, max_steps=2, eval_batch_size=len(held)
    )
    (last,) = got["evals"]
    assert last.is_full and last.rows == len(held) and math.isfinite(last.valid_loss)
    ref = _trl_eval_loss(model_root, loaded, method, held, cfg)
    assert last.valid_loss == pytest.approx(ref, rel=REL)


def test_training_with_validation_is_training_without_it_bit_for_bit(model_root, tmp_path):
    vocab = 640
    train, held = _token_rows(8, 0, vocab), _token_rows(5, 1, vocab)
    runs = [
        _train(model_root, tmp_path / name, TrainMethod.SFT, DatasetFormat.TOKENS, train, val, **fields)
        for name, val, fields in (
            ("off", None, {}),
            ("on", held, dict(eval_every_steps=1, eval_batch_size=3)),
        )
    ]
    (a, _, off), (b, _, on) = runs
    assert len(on["evals"]) == 4 and not off["evals"]
    trace = lambda got: [(s.step, s.loss, s.grad_norm) for s in got["steps"]]  # noqa: E731
    assert trace(on) == trace(off)  # the same fp32 operations in the same order: equal, not close
    sa, sb = (dict(m.model.named_parameters()) for m in (a, b))
    assert all(torch.equal(sa[n], sb[n]) for n in sa if "lora_" in n)


def test_keep_best_picks_the_checkpoint_of_least_valid_loss_and_checks_its_schedule():
    from strop.common.trainer_types import Checkpoint

    ckpts = [Checkpoint(step=s, valid_loss=v) for s, v in ((2, 3.0), (4, 1.5), (6, 1.5), (8, 2.0))]
    assert validation.best_of(ckpts).step == 4  # the least; the earliest of equals
    assert validation.best_of([]) is None
    ok = job_config.with_defaults(
        TrainConfig(method=TrainMethod.SFT, keep_best_checkpoint=True, eval_every_steps=5), session_max_len=64
    )
    assert ok.checkpoint_every_steps == 5 and ok.eval_batch_size == ok.batch_size
    for fields, says in (
        (dict(eval_every_steps=0), "keep_best_checkpoint needs eval_every_steps > 0"),
        (dict(eval_every_steps=6, checkpoint_every_steps=4), "must be a multiple of checkpoint_every_steps"),
        (dict(eval_every_steps=-1), "eval_every_steps must be >= 0"),
    ):
        with pytest.raises(InvalidArgument, match=says):
            job_config.with_defaults(
                TrainConfig(method=TrainMethod.SFT, keep_best_checkpoint=True, **fields), session_max_len=64
            )


def test_metrics_csv_has_openais_columns_and_a_row_a_step():
    from strop.common.trainer_types import EvalMetrics, JobEvent, StepMetrics

    class Store:
        def events_after(self, job_id, seq, limit=1000):
            events = [
                JobEvent(seq=1, step=StepMetrics(step=1, loss=2.5)),
                JobEvent(seq=2, step=StepMetrics(step=2, loss=2.0)),
                JobEvent(seq=3, eval=EvalMetrics(step=2, valid_loss=2.25, valid_mean_token_accuracy=0.5)),
                JobEvent(seq=4, step=StepMetrics(step=3, loss=1.75)),
                JobEvent(
                    seq=5,
                    eval=EvalMetrics(
                        step=3,
                        valid_loss=2.0,
                        full_valid_loss=2.125,
                        is_full=True,
                        valid_mean_token_accuracy=0.5,
                        full_valid_mean_token_accuracy=0.25,
                    ),
                ),
            ]
            return [e for e in events if e.seq > seq]

    text = validation.metrics_csv(validation.metrics_rows(Store(), "job"))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0]) == validation.CSV_COLUMNS
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["train_loss"] == "2.5" and rows[0]["valid_loss"] == ""
    assert (rows[1]["valid_loss"], rows[1]["valid_mean_token_accuracy"], rows[1]["full_valid_loss"]) == (
        "2.25",
        "0.5",
        "",
    )
    assert (rows[2]["full_valid_loss"], rows[2]["full_valid_mean_token_accuracy"]) == ("2.125", "0.25")


# ---- over gRPC: the service's job path (events, checkpoints, best, CSV, resume, errors)


def test_a_job_over_grpc_evaluates_keeps_its_best_checkpoint_writes_its_csv_and_resumes_on_schedule(
    client, trainer, tmp_path
):
    from safetensors.torch import load_file

    from strop.client import InvalidArgumentError, NotFoundError
    from strop.common import auth

    vocab = 640
    s = client.load_model("tiny-llama", quantization=Quantization.NONE)
    client.attach_lora(s.session_id, LORA)
    train = client.upload_dataset(_token_rows(8, 0, vocab))
    held = client.upload_dataset(_token_rows(4, 1, vocab))
    # a learning rate this high overshoots: the validation loss is least before the last step
    cfg = TrainConfig(
        method=TrainMethod.SFT,
        learning_rate=0.3,
        lr_scheduler="constant",
        max_steps=4,
        batch_size=2,
        max_length=MAX_LEN,
        seed=0,
        eval_every_steps=1,
        keep_best_checkpoint=True,
    )
    events = list(client.train(s.session_id, train.dataset_id, cfg, validation_dataset_id=held.dataset_id))
    job = client.get_job(events[-1].job_id)
    assert job.state.value == "SUCCEEDED" and job.validation_dataset_id == held.dataset_id
    steps = {e.step.step: e.step for e in events if e.step}
    evals = {e.eval.step: e.eval for e in events if e.eval}
    ckpts = [e.checkpoint for e in events if e.checkpoint]
    assert sorted(evals) == [1, 2, 3, 4] and all(
        m.is_full for m in evals.values()
    )  # eval_rows 0: the whole set
    # keep_best checkpoints at every eval step; each carries its step's losses
    assert [c.step for c in ckpts] == [1, 2, 3, 4]
    for c in ckpts:
        assert (c.train_loss, c.valid_loss, c.full_valid_loss) == (
            steps[c.step].loss,
            evals[c.step].valid_loss,
            evals[c.step].full_valid_loss,
        )
    best = min(ckpts, key=lambda c: c.valid_loss)
    assert job.best_checkpoint.step == best.step and job.best_checkpoint.valid_loss == best.valid_loss
    assert best.step < 4, f"the overshooting run's valid losses {[c.valid_loss for c in ckpts]}"
    # the job's adapter is the best checkpoint's, tensor for tensor
    got = load_file(
        client.download_artifact(job.adapter.artifact_id, tmp_path / "adapter") / "adapter_model.safetensors"
    )
    want = load_file(
        client.download_artifact(best.artifact.artifact_id, tmp_path / "best") / "adapter_model.safetensors"
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the metrics CSV: a row a step, the floats read back exactly
    text = (
        client.download_artifact(job.metrics_csv.artifact_id, tmp_path / "csv") / "metrics.csv"
    ).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["train_loss"]) for r in rows] == [steps[i].loss for i in (1, 2, 3, 4)]
    assert [float(r["valid_loss"]) for r in rows] == [evals[i].valid_loss for i in (1, 2, 3, 4)]
    assert [float(r["full_valid_loss"]) for r in rows] == [evals[i].full_valid_loss for i in (1, 2, 3, 4)]

    # resumed without naming it: the same validation set, the schedule continued (steps 5 and 6)
    more = TrainConfig(**{**cfg.__dict__, "max_steps": 6, "keep_best_checkpoint": False})
    resumed = list(client.train(s.session_id, "", more, resume_from_job_id=job.job_id))
    job2 = client.get_job(resumed[-1].job_id)
    assert job2.state.value == "SUCCEEDED" and job2.validation_dataset_id == held.dataset_id
    assert [e.eval.step for e in resumed if e.eval] == [5, 6]

    # bad input: a bad validation row is refused at upload, naming its line; a validation set in another format,
    # and eval settings without a validation set, at Train
    with pytest.raises(InvalidArgumentError, match="line 2"):
        client.upload_dataset([{"input_ids": [5, 6, 7]}, {"input_ids": "not ids"}])
    text_set = client.upload_dataset([{"text": "some held-out text"}])
    with pytest.raises(InvalidArgumentError, match="validation_dataset_id: the validation set is text rows"):
        list(client.train(s.session_id, train.dataset_id, cfg, validation_dataset_id=text_set.dataset_id))
    with pytest.raises(InvalidArgumentError, match="need a validation set"):
        list(client.train(s.session_id, train.dataset_id, cfg))
    bad_ids = client.upload_dataset([{"input_ids": [5, 6, vocab + 7]}])
    with pytest.raises(
        InvalidArgumentError, match=f"validation_dataset_id {bad_ids.dataset_id}: row 1: token id"
    ):
        list(client.train(s.session_id, train.dataset_id, cfg, validation_dataset_id=bad_ids.dataset_id))
    with pytest.raises(NotFoundError):
        list(client.train(s.session_id, train.dataset_id, cfg, validation_dataset_id="ds-missing"))
    # another tenant's dataset is NOT_FOUND, as a missing one (the check Train makes, under that tenant)
    _, core, _ = trainer
    token = auth.set_current(auth.Principal(tenant="team-b"))
    try:
        with pytest.raises(NotFound) as exc:
            validation.load(core.datasets, held.dataset_id, job.config, DatasetFormat.TOKENS, vocab)
    finally:
        auth.reset_current(token)
    assert "not found" in str(exc.value)
    client.close_session(s.session_id)


@pytest.mark.gpu
def test_on_the_gpu_with_the_kernels_sft_valid_loss_matches_hf_peft_within_bf16(model_root, tmp_path):
    """The kernels on CUDA (the service's default there), bf16: strop's fused log-prob head evaluates; the reference is
    a fresh fp32 HF + PEFT model with the trained adapter (full logits). Bound: DESIGN's bf16 parity, 1e-2 relative (a
    bf16 forward of a 2-layer model against fp32: a few bf16 roundings, eps 7.8e-3, averaged in the loss's mean)."""
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE, dtype="bfloat16"),
        model_root=model_root,
        device="cuda:0",
    )
    model_loading.attach_lora(loaded, LORA)
    assert loaded.facts.kernels_enabled, loaded.facts.kernels_reason
    vocab = 640
    train, held = _token_rows(8, 0, vocab), _token_rows(6, 1, vocab)
    cfg = job_config.with_defaults(
        TrainConfig(
            method=TrainMethod.SFT,
            learning_rate=LR,
            max_steps=4,
            batch_size=2,
            max_length=MAX_LEN,
            eval_every_steps=2,
            eval_batch_size=3,
            seed=0,
        ),
        session_max_len=MAX_LEN,
    )
    evals = []
    sinks = training.Sinks(lambda m: None, lambda s, p: None, lambda n: None, on_eval=evals.append)
    training.run_training(
        loaded,
        train,
        DatasetFormat.TOKENS,
        cfg,
        tmp_path / "w",
        training.JobControl(),
        sinks,
        validation=ValidationSet("ds", held),
    )
    assert [e.step for e in evals] == [2, 4]
    ref = _reference_model(model_root, loaded).to("cuda")  # fp32 HF + PEFT, the trained adapter
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for row in held:
            ids = torch.tensor([row["input_ids"]], device="cuda")
            logp = torch.log_softmax(ref(input_ids=ids).logits[0, :-1].float(), -1).gather(
                -1, ids[0, 1:, None]
            )[:, 0]
            mask = torch.tensor(row["completion_mask"][1:], dtype=torch.bool, device="cuda")
            nll += -logp[mask].sum().item()
            tokens += int(mask.sum())
    assert evals[-1].full_valid_loss == pytest.approx(nll / tokens, rel=1e-2)


def test_a_job_on_several_ranks_or_of_a_method_without_a_held_out_loss_refuses_a_validation_set():
    from strop.common.trainer_types import DatasetInfo

    class Datasets:
        def rows(self, dataset_id):
            return DatasetInfo(dataset_id=dataset_id, format=DatasetFormat.TEXT), [{"text": "held out"}]

    cfg = job_config.with_defaults(TrainConfig(method=TrainMethod.SFT, num_devices=2), session_max_len=64)
    with pytest.raises(
        InvalidArgument, match="validation runs in single-process jobs only; this job has 2 ranks"
    ):
        validation.load(Datasets(), "ds-1", cfg, DatasetFormat.TEXT, 640)
    assert validation.load(Datasets(), "", replace(cfg, num_devices=1), DatasetFormat.TEXT, 640) is None
    # GRPO takes a validation set (its held-out prompts' mean reward, tests/trainer_svc/test_grpo.py), of its format
    with pytest.raises(
        InvalidArgument, match="the validation set is text rows and the training set prompts rows"
    ):
        validation.load(Datasets(), "ds-1", TrainConfig(method=TrainMethod.GRPO), DatasetFormat.PROMPTS, 640)


def test_the_cli_trains_with_a_validation_file_and_prints_each_evaluation(client, trainer, tmp_path, capsys):
    import json

    from strop.cli.main import main

    running, _, _ = trainer
    target = ["--target", f"127.0.0.1:{running.port}"]
    data, held, bad = tmp_path / "train.jsonl", tmp_path / "valid.jsonl", tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _token_rows(4, 0, 640)))
    held.write_text("".join(json.dumps(r) + "\n" for r in _token_rows(2, 1, 640)))
    bad.write_text('{"input_ids": [5, 6]}\nnot json\n')
    args = [
        "train",
        "--model",
        "tiny-llama",
        "--quantization",
        "none",
        "--dataset",
        str(data),
        "--max-steps",
        "2",
        "--batch-size",
        "2",
        "--max-length",
        str(MAX_LEN),
        "--r",
        "4",
        *target,
    ]
    before = len(client.list_sessions(include_closed=True))
    assert main([*args, "--validation-file", str(bad), "--eval-every", "1"]) == 1
    assert "line 2" in capsys.readouterr().err
    assert len(client.list_sessions(include_closed=True)) == before, (
        "no model was loaded for a bad validation file"
    )
    assert main([*args, "--validation-file", str(held), "--eval-every", "1", "--keep-best"]) == 0
    out = capsys.readouterr()
    assert re.findall(r"eval at step (\d): valid_loss", out.err) == ["1", "2"]
    job = json.loads(out.out)
    assert job["best_checkpoint"]["step"] in (1, 2) and job["metrics_csv"]["artifact_id"]
    assert job["last_eval"]["step"] == 2 and job["last_eval"]["is_full"]
