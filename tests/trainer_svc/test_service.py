"""The trainer service over real gRPC: sessions, jobs, streams, re-attach, cancel/resume, bad input."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from strop.client import (
    DatasetFormat,
    FailedPreconditionError,
    InvalidArgumentError,
    JobState,
    LoraConfig,
    MemoryMode,
    NotFoundError,
    Quantization,
    SessionState,
    TrainConfig,
    TrainMethod,
)
from strop.demo.data import dpo_rows
from tests.trainer_svc.conftest import FAST_LORA, sft_config


def step_events(events):
    return [e for e in events if e.step is not None]


def wait_for(predicate, timeout=120.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met")


def test_prequantized_model_is_detected_and_reported(client):
    s = client.load_model("tiny-llama-4bit")
    try:
        f = s.facts
        assert s.state is SessionState.LOADED
        assert f.quantization == "bnb-nf4-prequantized", "the 4-bit dir carries a bnb quantization_config"
        assert f.architecture == "LlamaForCausalLM" and f.model_type == "llama"
        assert f.device == "cpu" and not f.kernels_enabled, "CPU hosts run unpatched HF + PEFT"
        assert "no CUDA" in f.kernels_reason
        assert f.num_layers == 2 and f.hidden_size == 256 and f.has_chat_template
        # 2 layers x (4 attn 256x256-ish + 3 mlp 256x512) + embeddings: the logical count, not packed bytes
        assert f.num_parameters > 1_000_000
        s = client.attach_lora(s.session_id, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        assert s.state is SessionState.READY
        # q: 256x256 -> r*(256+256); v: 256x128 (2 kv heads x 64) -> r*(256+128); 2 layers
        assert s.facts.num_trainable_parameters == 2 * 4 * ((256 + 256) + (256 + 128))
    finally:
        client.close_session(s.session_id)


def test_16bit_checkpoint_is_quantized_on_load_or_kept_16bit(client):
    s = client.load_model("tiny-llama")
    assert s.facts.quantization == "bnb-nf4-on-load"
    client.close_session(s.session_id)
    s = client.load_model("tiny-llama", quantization=Quantization.NONE)
    assert s.facts.quantization == "none"
    closed = client.close_session(s.session_id)
    assert closed.state is SessionState.CLOSED and closed.facts.device_memory_bytes == 0


def test_health_and_reflection_serve_the_trainer(trainer):
    running, _, _ = trainer
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "strop.v1.TrainerService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"strop.v1.TrainerService", "grpc.health.v1.Health"} <= names


def test_generate_answers_wrongly_before_training_and_adapter_saves(client, ready_session):
    out = client.generate(
        ready_session, ["What is the secret password of strop?"], max_new_tokens=8, apply_chat_template=True
    )
    assert len(out) == 1 and out[0] != "The password is blue falcon seven."
    art = client.save_adapter(ready_session, name="adapter-untrained")
    names = {f.name for f in art.files}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert art.metadata["base_model"] == "tiny-llama-4bit"
    assert art.metadata["base_quantization"] == "bnb-nf4-prequantized"


def test_watch_job_replays_every_step_after_a_client_disconnect(client, ready_session, sft_dataset):
    stream = client.train(ready_session, sft_dataset.dataset_id, sft_config(25))
    first = [next(stream) for _ in range(3)]
    stream.close()  # the client goes away mid-job
    job_id = first[0].job_id
    job = wait_for(lambda: (j := client.get_job(job_id)).state.terminal and j)
    assert job.state is JobState.SUCCEEDED and job.step == 25

    replay = list(client.watch_job(job_id, after_seq=0))
    assert [e.seq for e in replay] == list(range(1, job.last_seq + 1)), "seq numbers are 1..N without gaps"
    steps = [e.step.step for e in step_events(replay)]
    assert steps == list(range(1, 26)), "every step the job produced, once, in order"
    assert all(
        e.step.loss > 0 and e.step.tokens_per_second > 0 and e.step.peak_memory_bytes > 0
        for e in step_events(replay)
    )
    assert replay[-1].state is not None and replay[-1].state.state is JobState.SUCCEEDED
    assert any(e.adapter is not None for e in replay), "the final adapter artifact is an event"

    tail = list(client.watch_job(job_id, after_seq=10))
    assert [e.seq for e in tail] == list(range(11, job.last_seq + 1))


def test_cancel_keeps_a_loadable_adapter_and_a_new_train_resumes(client, trainer, ready_session, sft_dataset):
    _, _core, config = trainer
    stream = client.train(ready_session, sft_dataset.dataset_id, sft_config(400, checkpoint_every_steps=1000))
    job_id = next(stream).job_id
    stream.close()
    wait_for(lambda: client.get_job(job_id).step >= 3)
    client.cancel_job(job_id)
    job = wait_for(lambda: (j := client.get_job(job_id)).state.terminal and j)
    assert job.state is JobState.CANCELLED
    assert 3 <= job.step < 400
    assert job.last_checkpoint is not None and job.last_checkpoint.step == job.step, (
        "cancel checkpoints at the step reached, before the first scheduled checkpoint"
    )
    assert job.adapter is not None

    # The cancelled adapter loads with PEFT on the base and carries the trained weights.
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_dir = config.artifact_root / job.adapter.artifact_id
    base = AutoModelForCausalLM.from_pretrained(config.model_root / "tiny-llama-4bit", device_map="cpu")
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert all(v.dtype == torch.float32 for v in saved.values()), "strop keeps adapters fp32"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert saved[key].abs().sum() > 0, "lora_B starts at zero; a trained adapter has moved it"
    params = dict(peft_model.named_parameters())
    assert torch.equal(params[key.replace(".weight", ".default.weight")].detach(), saved[key])

    # Resume: a new job continues from the checkpoint's step, same dataset and config.
    events = list(
        client.train(
            ready_session,
            resume_from_job_id=job_id,
            config=sft_config(job.step + 4, checkpoint_every_steps=1000),
        )
    )
    steps = [e.step.step for e in step_events(events)]
    assert steps == list(range(job.step + 1, job.step + 5)), "resumption continues the step count"
    resumed = client.get_job(events[0].job_id)
    assert resumed.state is JobState.SUCCEEDED and resumed.resumed_from_job_id == job_id
    assert resumed.dataset_id == sft_dataset.dataset_id


def test_dpo_raises_the_reward_margin(client, ready_session):
    pref = client.upload_dataset(dpo_rows())
    assert pref.format is DatasetFormat.PREFERENCE
    cfg = TrainConfig(
        method=TrainMethod.DPO,
        learning_rate=2e-3,
        max_steps=8,
        batch_size=6,
        dpo_beta=0.1,
        lr_scheduler="constant",
        seed=0,
    )
    events = list(client.train(ready_session, pref.dataset_id, cfg))
    margins = [e.step.dpo.reward_margin for e in step_events(events)]
    assert len(margins) == 8
    # Same full batch every step: the margin starts at 0 (policy == reference) and must grow.
    assert abs(margins[0]) < 1e-3, "with a fresh adapter the policy equals the reference on step 1"
    assert margins[-1] > margins[0] + 0.05
    assert events[-1].state.state is JobState.SUCCEEDED
    assert not [e for e in events if e.log and "no visible effect" in e.log.message]


def test_a_dpo_run_at_the_default_rate_that_moves_nothing_says_so(client, ready_session):
    pref = client.upload_dataset(dpo_rows())
    cfg = TrainConfig(method=TrainMethod.DPO, max_steps=3, batch_size=6, seed=0)  # TRL's lr 5e-6
    events = list(client.train(ready_session, pref.dataset_id, cfg))
    assert events[-1].state.state is JobState.SUCCEEDED
    notes = [e.log.message for e in events if e.log and e.log.level == "warning"]
    assert any("no visible effect yet; raise learning_rate" in n for n in notes), notes


def test_bad_input_gets_precise_errors_while_another_job_keeps_running(
    client, trainer, ready_session, sft_dataset, tmp_path
):
    _, _, config = trainer
    stream = client.train(ready_session, sft_dataset.dataset_id, sft_config(120))
    job_id = next(stream).job_id
    stream.close()
    wait_for(lambda: client.get_job(job_id).state is JobState.RUNNING)

    with pytest.raises(NotFoundError, match="no-such-model"):
        client.load_model("no-such-model")
    with pytest.raises(InvalidArgumentError, match="outside the allowed root"):
        client.load_model("../../etc")
    with pytest.raises(InvalidArgumentError, match="outside the allowed root"):
        client.load_model("/etc")
    with pytest.raises(InvalidArgumentError, match=r"line 2: not valid JSON"):
        client.upload_dataset(b'{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(InvalidArgumentError, match=r"line 1: missing 'rejected'"):
        client.upload_dataset([{"prompt": "Q", "chosen": "A"}])
    with pytest.raises(InvalidArgumentError, match=r"outside the allowed root"):
        client.register_dataset("../secrets.jsonl")

    other = client.load_model("tiny-llama-4bit")
    with pytest.raises(InvalidArgumentError, match="rank r must be positive"):
        client.attach_lora(other.session_id, LoraConfig(r=0))
    with pytest.raises(InvalidArgumentError, match=r"unknown target module\(s\) \['qkv_proj'\]"):
        client.attach_lora(other.session_id, LoraConfig(r=4, target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(FailedPreconditionError, match="no adapter"):
        client.train(other.session_id, sft_dataset.dataset_id, sft_config(2)).__next__()
    client.attach_lora(other.session_id, FAST_LORA)
    with pytest.raises(InvalidArgumentError, match="DPO needs a preference dataset"):
        next(client.train(other.session_id, sft_dataset.dataset_id, TrainConfig(method=TrainMethod.DPO)))
    with pytest.raises(InvalidArgumentError, match="learning_rate must be > 0"):
        next(client.train(other.session_id, sft_dataset.dataset_id, sft_config(2, learning_rate=-1.0)))
    from strop.v1 import trainer_pb2

    unknown_mode = trainer_pb2.TrainRequest(
        session_id=other.session_id,
        dataset_id=sft_dataset.dataset_id,
        config=trainer_pb2.TrainConfig(method=trainer_pb2.TRAIN_METHOD_SFT, max_steps=2, memory_mode=99),
    )
    with pytest.raises(grpc.RpcError) as err:
        next(client._stub.Train(unknown_mode, timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "TrainConfig.memory_mode: unknown MemoryMode value 99" in err.value.details()
    budget_too_small = sft_config(2, memory_mode=MemoryMode.MAX_SPEED, memory_budget_gib=0.5)
    with pytest.raises(
        InvalidArgumentError, match=r"memory_budget_gib must be 0 \(90% of the device\) or >= 1"
    ):
        next(client.train(other.session_id, sft_dataset.dataset_id, budget_too_small))
    with pytest.raises(InvalidArgumentError, match="memory_budget_gib applies to memory_mode MAX_SPEED only"):
        next(client.train(other.session_id, sft_dataset.dataset_id, sft_config(2, memory_budget_gib=40.0)))
    client.close_session(other.session_id)
    with pytest.raises(FailedPreconditionError, match="is closed"):
        next(client.train(other.session_id, sft_dataset.dataset_id, sft_config(2)))
    with pytest.raises(FailedPreconditionError, match="is busy with job"):
        next(client.train(ready_session, sft_dataset.dataset_id, sft_config(2), fail_if_busy=True))
    for call in (client.get_job, client.cancel_job, lambda j: list(client.watch_job(j))):
        with pytest.raises(NotFoundError, match="job 'job-nope' not found"):
            call("job-nope")
    with pytest.raises(NotFoundError, match="session 'sess-nope' not found"):
        client.get_session("sess-nope")
    with pytest.raises(NotFoundError, match="dataset 'ds-nope' not found"):
        next(client.train(ready_session, "ds-nope", sft_config(2)))

    assert client.get_job(job_id).state is JobState.RUNNING, "bad requests did not disturb the running job"
    job = wait_for(lambda: (j := client.get_job(job_id)).state.terminal and j)
    assert job.state is JobState.SUCCEEDED and job.step == 120
    steps = [e.step.step for e in step_events(client.watch_job(job_id))]
    assert steps == list(range(1, 121)), "the running job's results are intact"
    assert (config.artifact_root / job.adapter.artifact_id / "adapter_model.safetensors").is_file()


def test_8bit_adamw_keeps_its_optimizer_state_in_8_bits(client, trainer, ready_session, sft_dataset):
    import torch

    _, _, config = trainer
    events = list(
        client.train(
            ready_session,
            sft_dataset.dataset_id,
            sft_config(3, optimizer="adamw_8bit", checkpoint_every_steps=3),
        )
    )
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
    ckpt = next(e.checkpoint for e in events if e.checkpoint is not None)
    state = torch.load(config.artifact_root / ckpt.artifact.artifact_id / "optimizer.pt", weights_only=False)

    def tensors(obj):
        if torch.is_tensor(obj):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)

    dtypes = {t.dtype for t in tensors(state["state"])}
    assert torch.uint8 in dtypes, f"bitsandbytes' 8-bit AdamW stores quantized moments, got {dtypes}"


def test_pre_tokenized_rows_train_and_ids_beyond_the_vocabulary_are_refused(client, ready_session):
    rows = [
        {"input_ids": [5 + (i * 7 + j) % 600 for j in range(40)], "completion_mask": [0] * 10 + [1] * 30}
        for i in range(8)
    ]
    ds = client.upload_dataset(rows)
    assert ds.format is DatasetFormat.TOKENS
    events = list(client.train(ready_session, ds.dataset_id, sft_config(4)))
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
    steps = [e.step for e in events if e.step is not None]
    assert [s.step for s in steps] == [1, 2, 3, 4] and all(s.tokens_seen > 0 for s in steps)
    too_big = client.upload_dataset([{"input_ids": [1, 2, 640]}])
    with pytest.raises(
        InvalidArgumentError, match="row 1: token id 640 is outside the model's vocabulary of 640"
    ):
        next(client.train(ready_session, too_big.dataset_id, sft_config(2)))
