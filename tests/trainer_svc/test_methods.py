"""ORPO, KTO and SimPO: strop's trainer core runs TRL's own trainers with the job's hyperparameters.

Parity: on the CPU the trainer runs unpatched HF + PEFT, so strop's path (``models.load_model`` +
``attach_lora`` + ``training.run_training``) and a user's TRL script on HF + PEFT with the same hyperparameters
perform the same fp32 operations in the same order: their per-step losses and final adapters must be bitwise
equal. Any difference is plumbing (a hyperparameter strop passes differently, a reference model, a dataset
column, a dtype). The e2e tests go through gRPC and check that each method moves its metric the right way.
"""

from __future__ import annotations

import math

import pytest
import torch

from strop.common.trainer_types import (
    DatasetFormat,
    JobState,
    LoadModelRequest,
    LoraConfig,
    Quantization,
    TrainConfig,
    TrainMethod,
)
from strop.demo.data import dpo_rows
from strop.trainer_svc.core import job_config, model_loading, training

LORA = LoraConfig(r=8, alpha=16, seed=0)
STEPS = 3
MAX_LEN = 64
BATCH = 4
LR = 2e-3


def kto_rows() -> list[dict]:
    """Unpaired rows from the preference rows, desirable and undesirable interleaved (every batch has both)."""
    out = []
    for r in dpo_rows():
        out.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True})
        out.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False})
    return out


# method -> (its dataset rows, strop's TrainConfig fields, the same hyperparameters as TRL's config names them)
CASES = {
    TrainMethod.ORPO: (dpo_rows, dict(orpo_lambda=0.25), dict(beta=0.25)),
    TrainMethod.SIMPO: (
        dpo_rows,
        dict(simpo_beta=2.5, simpo_gamma=0.4),
        dict(loss_type="simpo", cpo_alpha=0.0, beta=2.5, simpo_gamma=0.4),
    ),
    TrainMethod.KTO: (
        kto_rows,
        dict(kto_beta=0.2, kto_desirable_weight=1.5, kto_undesirable_weight=0.75),
        dict(beta=0.2, desirable_weight=1.5, undesirable_weight=0.75),
    ),
}


def _strop_run(model_root, tmp_path, method, optimizer="adamw_torch", kernels=False):
    rows, fields, _ = CASES[method]
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE),
        model_root=model_root,
        device="cpu",
    )
    model_loading.attach_lora(loaded, LORA)
    # the service turns the kernels on only on CUDA; forced here after loading, the job runs strop's chunked
    # loss inside the TRL trainer (what a CUDA job does) on the CPU's unpatched model
    loaded.facts.kernels_enabled = kernels
    cfg = job_config.with_defaults(
        TrainConfig(
            method=method,
            learning_rate=LR,
            lr_scheduler="constant",
            max_steps=STEPS,
            batch_size=BATCH,
            max_length=MAX_LEN,
            seed=0,
            optimizer=optimizer,
            **fields,
        ),
        session_max_len=MAX_LEN,
    )
    steps: list = []
    sinks = training.Sinks(on_step=steps.append, on_checkpoint=lambda s, p: None, on_start=lambda n: None)
    data = rows()
    fmt = DatasetFormat.UNPAIRED_PREFERENCE if method is TrainMethod.KTO else DatasetFormat.PREFERENCE
    job_config.check_dataset_fits(cfg, fmt, data, loaded.facts.vocab_size)
    training.run_training(loaded, data, fmt, cfg, tmp_path / "strop", training.JobControl(), sinks)
    hidden_head = "_strop_hidden_head" in loaded.model.get_base_model().__dict__
    assert hidden_head is kernels, "strop's chunked loss runs exactly when the kernels are on"
    return steps, _adapter(loaded.model)


def _trl_run(model_root, tmp_path, method, optim="adamw_torch"):
    """What a user writes: HF + PEFT, TRL's trainer and config for the method, the same hyperparameters."""
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    rows, _, trl_fields = CASES[method]
    path = model_root / "tiny-llama"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(LORA.seed)
    model = get_peft_model(
        model,
        PeftLoraConfig(
            r=LORA.r,
            lora_alpha=LORA.alpha,
            lora_dropout=0.0,
            target_modules=list(LORA.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    if method is TrainMethod.ORPO:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    elif method is TrainMethod.SIMPO:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl import KTOConfig as Config
        from trl import KTOTrainer as Trainer
    args = Config(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=STEPS,
        max_length=MAX_LEN,
        optim=optim,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's preference configs default to bf16; strop trains fp32 on the CPU
        gradient_checkpointing=False,  # TRL's default is on; strop's is off
        **trl_fields,
    )
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows()),
        processing_class=tokenizer,
        callbacks=[Losses()],
    ).train()
    return losses, _adapter(model)


def _adapter(model) -> dict[str, torch.Tensor]:
    return {
        n.replace(".default", ""): p.detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n and ".default." in n
    }


@pytest.mark.parity
@pytest.mark.parametrize("method", list(CASES), ids=lambda m: m.value.lower())
def test_strop_trains_like_trl_on_hf_peft(model_root, tmp_path, method):
    steps, strop_adapter = _strop_run(model_root, tmp_path, method)
    trl_losses, trl_adapter = _trl_run(model_root, tmp_path, method)
    strop_losses = [s.loss for s in steps]
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in strop_losses)
    # the same fp32 operations in the same order on the same CPU: bitwise equal (see the module docstring)
    assert strop_losses == trl_losses
    assert strop_adapter.keys() == trl_adapter.keys() and strop_adapter
    differ = [n for n in trl_adapter if not torch.equal(strop_adapter[n], trl_adapter[n])]
    assert not differ, f"{len(differ)} of {len(trl_adapter)} adapter tensors differ, e.g. {differ[:3]}"
    moved = [n for n in trl_adapter if "lora_B" in n and strop_adapter[n].abs().sum() > 0]
    assert moved, "lora_B starts at zero; a trained adapter has moved it"


@pytest.mark.parity
@pytest.mark.parametrize("method", list(CASES), ids=lambda m: m.value.lower())
def test_with_kernels_on_each_method_runs_strops_chunked_loss_like_trl(model_root, tmp_path, method):
    from strop.kernels.trainers import StropCPOMixin, StropKTOMixin, StropORPOMixin

    mixin = {
        TrainMethod.ORPO: StropORPOMixin,
        TrainMethod.SIMPO: StropCPOMixin,
        TrainMethod.KTO: StropKTOMixin,
    }
    assert issubclass(training.strop_preference_trainer_class(method), mixin[method])
    steps, strop_adapter = _strop_run(model_root, tmp_path, method, optimizer="sgd", kernels=True)
    trl_losses, trl_adapter = _trl_run(model_root, tmp_path, method, optim="sgd")
    # the same loss from per-sequence sums taken in another order (tests/kernels/losses/test_preference.py):
    # fp32 rounding ≈1e-7 relative per step, carried forward linearly by SGD; 1e-5 holds with a wide margin
    for step, (a, b) in enumerate(zip([s.loss for s in steps], trl_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step + 1}: strop {a} vs TRL {b}"
    assert strop_adapter.keys() == trl_adapter.keys() and strop_adapter
    for name, ref in trl_adapter.items():
        torch.testing.assert_close(strop_adapter[name], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    streamed = steps[-1].dpo
    assert streamed.logps_chosen != 0 and streamed.logps_rejected != 0, (
        "each step streams the method's metrics"
    )
    if method is TrainMethod.ORPO:
        assert streamed.nll_loss > 0 and streamed.log_odds_ratio < 0
    if method is TrainMethod.KTO:
        assert streamed.kl >= 0 and streamed.reward_margin != 0


# ---- through gRPC: each method moves its metric the right way on the tiny 4-bit model ---------------------


def _preference_steps(client, session_id, rows, method, steps=8, **fields):
    """``steps`` steps on the same batch of 6 rows (r=8 adapter on the 4-bit model); each step's metrics."""
    ds = client.upload_dataset(rows)
    cfg = TrainConfig(
        method=method,
        learning_rate=2e-3,
        max_steps=steps,
        batch_size=6,
        lr_scheduler="constant",
        seed=0,
        **fields,
    )
    events = list(client.train(session_id, ds.dataset_id, cfg))
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1]
    metrics = [e.step.dpo for e in events if e.step]
    assert len(metrics) == steps and all(m is not None for m in metrics)
    return ds, metrics


def test_orpo_raises_the_log_odds_of_the_chosen_answers(client, ready_session):
    ds, m = _preference_steps(client, ready_session, dpo_rows(), TrainMethod.ORPO)
    assert ds.format is DatasetFormat.PREFERENCE
    # the same 6 pairs every step: ORPO's odds-ratio term pushes log odds(chosen) - log odds(rejected) up
    assert m[-1].log_odds_chosen > m[0].log_odds_chosen + 0.1
    assert m[-1].reward_margin > m[0].reward_margin
    assert m[-1].nll_loss < m[0].nll_loss, "ORPO's SFT term lowers the chosen answers' NLL"
    assert all(x.log_odds_ratio < 0 for x in m), "log sigmoid(...) is negative"


def test_simpo_raises_the_reward_margin(client, ready_session):
    _, m = _preference_steps(client, ready_session, dpo_rows(), TrainMethod.SIMPO)
    # SimPO's reward is beta * the mean log-prob of an answer (no reference): the margin must grow
    assert m[-1].reward_margin > m[0].reward_margin + 0.1
    assert m[-1].logps_chosen > m[0].logps_chosen


def test_kto_raises_the_reward_margin_from_zero(client, ready_session):
    ds, m = _preference_steps(client, ready_session, kto_rows(), TrainMethod.KTO)
    assert ds.format is DatasetFormat.UNPAIRED_PREFERENCE
    # a fresh adapter: the policy equals the reference (the base), so rewards start at 0, then the margin grows
    assert abs(m[0].reward_margin) < 1e-3
    assert m[-1].reward_margin > m[0].reward_margin + 0.05
    assert m[-1].rewards_chosen > 0 > m[-1].rewards_rejected


# ---- configuration and datasets -----------------------------------------------------------------------------


def test_unset_hyperparameters_take_the_defaults_table():
    from strop.common.trainer_types import TRAIN_DEFAULTS

    for method, field in [
        (TrainMethod.ORPO, "orpo_lambda"),
        (TrainMethod.KTO, "kto_beta"),
        (TrainMethod.KTO, "kto_desirable_weight"),
        (TrainMethod.KTO, "kto_undesirable_weight"),
        (TrainMethod.SIMPO, "simpo_beta"),
        (TrainMethod.SIMPO, "simpo_gamma"),
    ]:
        c = job_config.with_defaults(TrainConfig(method=method, batch_size=2), session_max_len=MAX_LEN)
        assert getattr(c, field) == TRAIN_DEFAULTS[field], field
        assert c.learning_rate == TRAIN_DEFAULTS["learning_rate"][method.value]


@pytest.mark.parametrize(
    ("method", "fields", "message"),
    [
        (TrainMethod.ORPO, dict(orpo_lambda=float("nan")), "orpo_lambda must be a finite number"),
        (TrainMethod.ORPO, dict(orpo_lambda=-0.1), "orpo_lambda must be > 0"),
        (TrainMethod.KTO, dict(kto_beta=float("inf")), "kto_beta must be a finite number"),
        (TrainMethod.KTO, dict(kto_desirable_weight=-1.0), "kto_desirable_weight must be > 0"),
        (TrainMethod.KTO, dict(kto_undesirable_weight=-1.0), "kto_undesirable_weight must be > 0"),
        (TrainMethod.KTO, dict(batch_size=1), "KTO needs batch_size >= 2"),
        (TrainMethod.SIMPO, dict(simpo_gamma=-0.5), "simpo_gamma must be > 0"),
        (TrainMethod.SIMPO, dict(simpo_beta=float("-inf")), "simpo_beta must be a finite number"),
        (TrainMethod.ORPO, dict(dpo_reference="adapter_snapshot"), "ORPO has no reference model"),
        (TrainMethod.SIMPO, dict(packing=True), "packing applies to SFT only"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(method, fields, message):
    from strop.common.errors import InvalidArgument

    cfg = TrainConfig(method=method, **{"batch_size": 2, **fields})
    with pytest.raises(InvalidArgument, match=message):
        job_config.with_defaults(cfg, session_max_len=MAX_LEN)


@pytest.mark.parametrize(
    ("method", "fmt", "message"),
    [
        (TrainMethod.KTO, DatasetFormat.PREFERENCE, "KTO needs unpaired preference rows"),
        (TrainMethod.ORPO, DatasetFormat.UNPAIRED_PREFERENCE, "ORPO needs a preference dataset"),
        (TrainMethod.SIMPO, DatasetFormat.MESSAGES, "SIMPO needs a preference dataset"),
        (TrainMethod.SFT, DatasetFormat.UNPAIRED_PREFERENCE, "SFT needs text, messages or prompt/completion"),
    ],
)
def test_each_method_refuses_datasets_of_another_shape(method, fmt, message):
    from strop.common.errors import InvalidArgument

    cfg = job_config.with_defaults(TrainConfig(method=method, batch_size=2), session_max_len=MAX_LEN)
    with pytest.raises(InvalidArgument, match=message):
        job_config.check_dataset_fits(cfg, fmt, [], vocab_size=512)


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(CASES), ids=lambda m: m.value.lower())
def test_on_cuda_each_method_trains_on_the_kernels_like_unpatched(client, method):
    from strop.client import KernelMode
    from tests.trainer_svc.conftest import FAST_LORA

    rows, fields, _ = CASES[method]
    ds = client.upload_dataset(rows())
    runs = {}
    for mode in (KernelMode.UNSPECIFIED, KernelMode.OFF):
        s = client.load_model("tiny-llama-4bit", kernels=mode)
        assert s.facts.kernels_enabled is (mode is KernelMode.UNSPECIFIED), s.facts.kernels_reason
        client.attach_lora(s.session_id, FAST_LORA)
        cfg = TrainConfig(
            method=method,
            learning_rate=2e-3,
            max_steps=6,
            batch_size=6,
            lr_scheduler="constant",
            seed=0,
            **fields,
        )
        events = list(client.train(s.session_id, ds.dataset_id, cfg))
        assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
        runs[mode] = [e.step for e in events if e.step]
        client.close_session(s.session_id)
    patched, reference = runs[KernelMode.UNSPECIFIED], runs[KernelMode.OFF]
    # bf16 autocast on both paths: the first steps agree to bf16 noise (DESIGN: ≈1e-2 relative)
    for a, b in zip(patched[:3], reference[:3], strict=True):
        assert abs(a.loss - b.loss) <= 2e-2 * abs(b.loss), (
            [s.loss for s in patched],
            [s.loss for s in reference],
        )
    assert patched[-1].dpo.reward_margin > patched[0].dpo.reward_margin, "the kernel path raises the margin"
    assert patched[-1].tokens_per_second > 0


def test_the_cli_trains_kto_with_its_hyperparameters(trainer, tmp_path, capsys):
    import json

    from strop.cli.main import main

    running, _, _ = trainer
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in kto_rows()))
    argv = [
        "train",
        "--target",
        f"127.0.0.1:{running.port}",
        "--model",
        "tiny-llama-4bit",
        "--dataset",
        str(data),
    ]
    argv += ["--method", "kto", "--max-steps", "2", "--batch-size", "4", "--kto-desirable-weight", "1.5"]
    assert main(argv) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["state"] == "SUCCEEDED" and job["step"] == 2
    assert job["config"]["method"] == "KTO"
    # the CLI's flag reached the job; the rest took the defaults table
    assert job["config"]["kto_desirable_weight"] == 1.5 and job["config"]["kto_undesirable_weight"] == 1.0
