"""The step API (issue 34) on the CPU over real gRPC: training runs on one loaded tiny Llama (fp32), their
primitives against PEFT + torch.optim.AdamW done by hand, isolation between runs, exact state round trips, a
supervised and two toy RL loops, the sampler's log-probs against Forward's, concurrency and bad input.
"""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from strop.client import (
    AdamParams,
    Datum,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    RunLora,
    SamplingParams,
    TrainerClient,
)
from strop.common import auth
from strop.common.trainer_types import Quantization
from strop.trainer_svc.core import step_ops
from strop.v1 import trainer_pb2

SEQ = list(range(40, 61))  # 21 tokens of the tiny vocabulary (640)
SEQ2 = [7, 9, 300, 12, 500, 33, 1, 2, 3, 99, 100]


def ce_datum(tokens, weights=None) -> Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return Datum.of(tokens[:-1], target_tokens=tokens[1:], weights=w)


@pytest.fixture(scope="module")
def session_id(trainer):
    running, _, _ = trainer
    with TrainerClient(f"127.0.0.1:{running.port}") as c:
        s = c.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
        yield s.session_id


@pytest.fixture
def runs_core(trainer):
    return trainer[1].runs


def _loaded(trainer, session_id):
    return trainer[1].sessions.open(session_id).loaded


def _state(trainer, session_id, run_id):
    return step_ops.adapter_state_dict(_loaded(trainer, session_id), run_id)


def test_forward_backward_and_optim_step_equal_peft_and_adamw_by_hand(
    client, trainer, session_id, model_root
):
    """Two ForwardBackward + OptimStep rounds on one run against the same done by hand on a separate HF + PEFT
    model with the run's initial adapter, full logits and torch.optim.AdamW (foreach=False)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    run = client.create_training_run(session_id, RunLora(rank=4, alpha=8, seed=3))
    init = _state(trainer, session_id, run.run_id)
    ref = AutoModelForCausalLM.from_pretrained(model_root / "tiny-llama", dtype=torch.float32)
    ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=run.info.target_modules))
    set_peft_model_state_dict(ref, init)
    params = [p for p in ref.parameters() if p.requires_grad]
    adam = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False)
    weights = [0.5 * (i % 3) for i in range(len(SEQ) - 1)]  # real weights, some 0
    data = [ce_datum(SEQ, weights), ce_datum(SEQ2)]
    for _ in range(2):
        out = run.forward_backward(data, "cross_entropy")
        stats = run.optim_step(adam)
        opt.zero_grad()
        ref_loss, ref_lps = 0.0, []
        for d in data:
            ids = torch.tensor([d.model_input])
            t = torch.tensor(d.inputs()["target_tokens"].int_values)
            w = torch.tensor(d.inputs()["weights"].float_values)
            lp = ref(input_ids=ids).logits[0].float().log_softmax(-1).gather(1, t[:, None]).squeeze(1)
            loss = -(lp * w).sum()
            loss.backward()
            ref_loss += float(loss)
            ref_lps.append(lp.detach())
        ref_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        opt.step()
        # fp32 forward of a 2-layer model: per-token log-probs agree to ~1e-6 (chunked vs full logits, batch
        # padded vs one sequence); 1e-5 leaves an order of magnitude
        for got, want in zip(out.loss_fn_outputs, ref_lps, strict=True):
            torch.testing.assert_close(torch.tensor(got.logprobs), want, rtol=1e-5, atol=1e-5)
        assert {m.name for m in out.metrics} == {"loss:sum"}
        assert out.metrics[0].value == pytest.approx(ref_loss, rel=1e-5)
        norm = next(m.value for m in stats.metrics if m.name == "grad_norm:mean")
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    got = _state(trainer, session_id, run.run_id)
    from peft import get_peft_model_state_dict

    want = get_peft_model_state_dict(ref)
    # Adam's update is lr·m̂/(√v̂+eps): a relative gradient error δ ≈ 1e-5 moves it by ≲ lr·δ per step, except
    # where |g| ≲ eps; two steps at lr 1e-3 → 2e-8 plus rounding of values of size ~1e-2: atol 1e-6
    for k in want:
        torch.testing.assert_close(got[k], want[k].cpu(), rtol=0, atol=1e-6)
    assert any((got[k] - init[k]).abs().max() > 1e-4 for k in want), "the adapter must have moved"
    run.delete()


def test_optim_step_without_gradients_fails_and_changes_nothing(client, trainer, session_id):
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    before = _state(trainer, session_id, run.run_id)
    with pytest.raises(FailedPreconditionError, match="no gradients"):
        run.optim_step()
    after = _state(trainer, session_id, run.run_id)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert run.refresh().step == 0
    run.delete()


def test_two_runs_never_touch_each_other(client, trainer, session_id, runs_core):
    a = client.create_training_run(session_id, RunLora(rank=4, seed=1))
    b = client.create_training_run(session_id, RunLora(rank=4, seed=2))
    b.forward_backward([ce_datum(SEQ2)])
    b.optim_step(AdamParams(learning_rate=1e-2))
    b_adapter = _state(trainer, session_id, b.run_id)
    b_opt = step_ops.optimizer_tensors(
        runs_core._runs[b.run_id].optimizer, runs_core._runs[b.run_id].param_names
    )
    for _ in range(3):
        a.forward_backward([ce_datum(SEQ)])
        a.optim_step(AdamParams(learning_rate=1e-2))
    a.forward_backward([ce_datum(SEQ)])  # a's gradients pending
    b_after = _state(trainer, session_id, b.run_id)
    rb = runs_core._runs[b.run_id]
    assert all(torch.equal(b_adapter[k], b_after[k]) for k in b_adapter), "b's adapter changed"
    b_opt_after = step_ops.optimizer_tensors(rb.optimizer, rb.param_names)
    assert all(torch.equal(b_opt[k], b_opt_after[k]) for k in b_opt), "b's optimizer state changed"
    assert all(p.grad is None for p in rb.params), "a's backward reached b's parameters"
    assert a.refresh().has_gradients and not b.refresh().has_gradients
    assert (a.info.step, b.info.step) == (3, 1)
    a.delete()
    b.delete()


def test_save_state_then_load_state_continues_bit_identically(client, trainer, session_id):
    run = client.create_training_run(session_id, RunLora(rank=4, seed=5))
    adam = AdamParams(learning_rate=5e-3, weight_decay=0.1, grad_clip_norm=1.0)

    def steps(r, n):
        for i in range(n):
            r.forward_backward([ce_datum(SEQ if i % 2 else SEQ2)])
            r.optim_step(adam)

    steps(run, 2)
    saved = run.save_state("step-api-state")
    assert saved.step == 2
    steps(run, 2)
    want = _state(trainer, session_id, run.run_id)
    resumed = client.create_training_run(session_id, from_state=saved.artifact_id)
    assert resumed.info.step == 2 and resumed.info.lora.rank == 4
    steps(resumed, 2)
    got = _state(trainer, session_id, resumed.run_id)
    assert all(torch.equal(got[k], want[k]) for k in want), (
        "a run loaded from its state must continue exactly"
    )
    # LoadState into an existing run rewinds it the same way
    run.load_state(saved.artifact_id)
    assert run.refresh().step == 2
    steps(run, 2)
    again = _state(trainer, session_id, run.run_id)
    assert all(torch.equal(again[k], want[k]) for k in want)
    # SaveWeights is an adapter artifact carrying its base, like any adapter the exporter reads
    art = client.get_artifact(run.save_weights("step-api-weights").artifact_id)
    assert art.kind == "adapter" and art.metadata["base_model"] == "tiny-llama" and art.metadata["r"] == "4"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {f.name for f in art.files}
    run.delete()
    resumed.delete()


def test_a_run_training_the_head_saves_its_pairs_without_the_base_head(
    client, trainer, session_id, runs_core
):
    """With the LM head a target (``train_unembed``) PEFT's default state dict would carry the frozen base head
    [vocab, hidden] too: snapshots and artifacts hold the run's pairs alone, and a state saved with the base head
    (as artifacts were before) still loads."""
    from safetensors import safe_open

    from strop.common.artifacts import key_of

    run = client.create_training_run(session_id, RunLora(rank=2, seed=0, train_unembed=True))
    state = _state(trainer, session_id, run.run_id)
    assert any("lm_head.lora_A" in k for k in state) and not any("base_layer" in k for k in state), list(
        state
    )
    saved = run.save_weights("head-pairs")
    path = (
        runs_core.artifacts.path_of(key_of(run.info.tenant, saved.artifact_id)) / "adapter_model.safetensors"
    )
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(state)
    head = _loaded(trainer, session_id).model.get_base_model().lm_head.base_layer.weight
    with torch.no_grad():
        moved = {k: v + 0.5 if "lora_B" in k else v for k, v in state.items()}
    older = {**moved, "base_model.model.lm_head.base_layer.weight": head.detach().cpu().clone()}
    step_ops.load_adapter_state(_loaded(trainer, session_id), run.run_id, older)
    got = _state(trainer, session_id, run.run_id)
    assert all(torch.equal(got[k], moved[k]) for k in moved), "the older state's pairs were loaded"
    run.delete()


def test_supervised_loop_lowers_the_loss(client, session_id):
    run = client.create_training_run(session_id, RunLora(rank=8, seed=0))
    losses = []
    for _ in range(10):
        fb = run.forward_backward_async([ce_datum(SEQ)])
        opt = run.optim_step_async(AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics[0].value)
        opt.result()
    # a random 640-token model starts near 20·ln 640 ≈ 129 nats; ten Adam steps at 3e-3 on one sequence take
    # it to ≈ 73 here (1e-2 overshoots and oscillates on this model)
    assert losses[-1] < 0.7 * losses[0], losses
    run.delete()


def _reward(tokens: list[int]) -> float:
    return 1.0 if tokens[0] < 320 else 0.0  # emit a token from the lower half of the vocabulary


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_toy_rl_loop_raises_the_reward(client, session_id, loss_fn):
    # a LoRA on the head (train_unembed: the recomputing chunked log-prob path) can raise half the vocabulary's
    # logits along one direction; the random model's next-token distribution is nearly flat (≈ −6.4 nats each)
    run = client.create_training_run(session_id, RunLora(rank=8, seed=0, train_unembed=True))
    prompt = [5, 6, 7, 8]

    def mean_reward(sampler_id, seed):
        out = run.sample(prompt, 64, SamplingParams(max_tokens=1, seed=seed), sampler_id=sampler_id)
        return sum(_reward(s.tokens) for s in out.sequences) / 64

    first = run.save_weights_for_sampler().sampler_id
    before = mean_reward(first, 1000)
    for it in range(12):
        sampler = run.save_weights_for_sampler().sampler_id
        out = run.sample(prompt, 16, SamplingParams(max_tokens=1, seed=it), sampler_id=sampler)
        rewards = [_reward(s.tokens) for s in out.sequences]
        mean = sum(rewards) / len(rewards)
        data = [
            Datum.of(
                prompt,
                target_tokens=[0] * (len(prompt) - 1) + s.tokens,
                logprobs=[0.0] * (len(prompt) - 1) + s.logprobs,
                advantages=[0.0] * (len(prompt) - 1) + [r - mean],
            )
            for s, r in zip(out.sequences, rewards, strict=True)
        ]
        run.forward_backward(data, loss_fn)
        run.optim_step(AdamParams(learning_rate=1e-2))
    after = mean_reward(run.save_weights_for_sampler().sampler_id, 1000)
    # the mean of 64 Bernoulli draws has a standard deviation ≤ 0.0625: a rise of 0.25 is 4σ
    assert after > before + 0.25, (before, after)
    run.delete()


def test_sample_logprobs_equal_forward_logprobs_of_the_sampled_tokens(client, session_id):
    run = client.create_training_run(session_id, RunLora(rank=4, seed=9))
    run.forward_backward([ce_datum(SEQ)])
    run.optim_step(AdamParams(learning_rate=1e-2))
    sampler = run.save_weights_for_sampler().sampler_id
    prompt = SEQ[:6]
    out = run.sample(
        prompt, 3, SamplingParams(max_tokens=6, seed=4), sampler_id=sampler, prompt_logprobs=True
    )
    want = run.forward([Datum.of(prompt[:-1], target_tokens=prompt[1:], weights=[0.0] * 5)]).loss_fn_outputs[
        0
    ]
    assert math.isnan(out.prompt_logprobs[0]) and len(out.prompt_logprobs) == len(
        prompt
    )  # nothing predicts token 0
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs[1:]), torch.tensor(want.logprobs), rtol=1e-5, atol=1e-5
    )
    for s in out.sequences:
        full = prompt + s.tokens
        datum = Datum.of(full[:-1], target_tokens=full[1:], weights=[0.0] * (len(full) - 1))
        lp = run.forward([datum]).loss_fn_outputs[0].logprobs[len(prompt) - 1 :]
        # the same weights in fp32, decoded with a KV cache vs one full forward: rounding only (1e-5 nats)
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lp), rtol=1e-5, atol=1e-5)
    run.delete()


def test_eight_clients_on_four_runs_at_once(client, trainer, session_id):
    running = trainer[0]
    runs = [client.create_training_run(session_id, RunLora(rank=2, seed=i)) for i in range(4)]
    errors: list[BaseException] = []

    def worker(k):
        try:
            with TrainerClient(f"127.0.0.1:{running.port}") as c:
                run = c.training_run(runs[k % 4].run_id)
                j = k // 4  # two clients per run; each owns every other (fb, opt) pair of seq ids, so the
                for i in range(3):  # run's order is fb, opt, fb, opt… however their calls interleave
                    seq = 1 + 4 * i + 2 * j
                    fb = run.forward_backward_async([ce_datum(SEQ2)], seq_id=seq)
                    opt = run.optim_step_async(AdamParams(learning_rate=1e-3), seq_id=seq + 1)
                    fb.result(timeout=120)
                    opt.result(timeout=120)
        except BaseException as exc:  # collected: the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    # every client pairs fb then optim on its run; two clients per run: 6 optimizer steps each
    assert [r.refresh().step for r in runs] == [6, 6, 6, 6]
    for r in runs:
        r.delete()


def test_futures_run_in_seq_order_and_duplicates_return_the_same_future(client, session_id):
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    late = run.optim_step_async(AdamParams(learning_rate=1e-3), seq_id=2)  # arrives before seq 1
    early = run.forward_backward_async([ce_datum(SEQ2)], seq_id=1)
    again = run.forward_backward_async([ce_datum(SEQ2)], seq_id=1)
    assert again.future_id == early.future_id
    early.result(timeout=60)
    assert late.result(timeout=60).metrics  # ran after seq 1, so it had gradients
    watched = [f.seq_id for _, f in zip(range(2), run.watch(0), strict=False)]
    assert watched == [1, 2]
    pending = run.forward_backward_async([ce_datum(SEQ2)], seq_id=10)  # a hole at 3..9: it waits
    assert client.cancel_future(pending.future_id).state.value == "CANCELLED"
    run.delete()


def test_bad_input_names_the_field_and_changes_nothing(client, trainer, session_id, runs_core):
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    before = _state(trainer, session_id, run.run_id)
    cases = [
        (
            [Datum.of([1, 2, 640], target_tokens=[2, 3, 4], weights=[1, 1, 1])],
            "cross_entropy",
            None,
            r"data\[0\].model_input\[2\] = 640 is outside the vocabulary",
        ),
        (
            [Datum.of([1, 2, 3], target_tokens=[2, 3], weights=[1, 1, 1])],
            "cross_entropy",
            None,
            r"data\[0\].loss_fn_inputs\['target_tokens'\] has shape \[2\]",
        ),
        (
            [
                Datum.of(
                    [1, 2, 3], target_tokens=[2, 3, 4], logprobs=[0, 0, 0], advantages=[0, float("nan"), 0]
                )
            ],
            "ppo",
            None,
            r"data\[0\].loss_fn_inputs\['advantages'\]\[1\] is nan",
        ),
        (
            [
                Datum.of(
                    [1, 2, 3],
                    target_tokens=[2, 3, 4],
                    logprobs=[0, 0, 0],
                    advantages=[0, 0, 0],
                    mask=[1, 1, 1],
                )
            ],
            "ppo",
            None,
            "'mask' is not an input of ppo",
        ),
        (
            [Datum.of([1, 2, 3], target_tokens=[2, 3, 4], logprobs=[0, 0, 0], advantages=[0, 0, 0])],
            "ppo",
            {"epsilon": 0.2},
            "unknown key 'epsilon' for ppo",
        ),
        (
            [Datum.of([1] * 2049, target_tokens=[2] * 2049, weights=[1] * 2049)],
            "cross_entropy",
            None,
            "max_seq_length is 2048",
        ),
    ]
    for data, loss, cfg, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            run.forward_backward_async(data, loss, cfg)
    with pytest.raises(ValueError, match="unknown loss_fn 'gspo'"):
        run.forward_backward_async([ce_datum(SEQ2)], "gspo")
    raw = trainer_pb2.ForwardBackwardRequest(run_id=run.run_id, loss_fn=99)
    with pytest.raises(InvalidArgumentError, match="unknown LossFn value 99"):
        client._call(client._stub.ForwardBackward, raw)
    with pytest.raises(NotFoundError):
        client.get_training_run("run-nope")
    mine = run.forward_async([ce_datum(SEQ2)])
    mine.result(timeout=60)
    token = auth.set_current(auth.Principal("someone-else"))
    try:  # another tenant sees neither the run nor its futures
        from strop.common.errors import NotFound

        with pytest.raises(NotFound, match="not found"):
            runs_core.get(run.run_id)
        with pytest.raises(NotFound, match="not found"):
            runs_core.get_future(mine.future_id)
        with pytest.raises(NotFound, match="not found"):
            runs_core.cancel(mine.future_id)
        assert run.run_id not in [r.run_id for r in runs_core.list()]
    finally:
        auth.reset_current(token)
    assert run.refresh().pending_futures == 0 and run.info.step == 0 and not run.info.has_gradients
    after = _state(trainer, session_id, run.run_id)
    assert all(torch.equal(before[k], after[k]) for k in before)
    run.delete()


def test_runs_take_turns_on_the_device_and_metrics_count_primitives(client, trainer, session_id):
    a = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    b = client.create_training_run(session_id, RunLora(rank=2, seed=1))
    long = [ce_datum(SEQ)] * 4
    queued = [a.forward_async(long) for _ in range(8)]
    late = b.forward_async([ce_datum(SEQ2)])
    b_done = late.result(timeout=120)
    a_done = [f.result(timeout=120) for f in queued]
    b_end = client.get_future(late.future_id).finished_at
    a_after = sum(client.get_future(f.future_id).finished_at > b_end for f in queued)
    # round robin: b's one primitive waits for at most the one of a's running and one more turn, not all 8
    assert a_after >= 5, a_after
    assert b_done.loss_fn_outputs and len(a_done) == 8
    reg = trainer[1].metrics.registry
    assert (
        reg.get_sample_value("strop_trainer_primitives_total", {"kind": "forward", "state": "succeeded"}) >= 9
    )
    tokens = reg.get_sample_value("strop_trainer_primitive_tokens_total", {"kind": "forward"})
    assert tokens >= 8 * 4 * (len(SEQ) - 1) + len(SEQ2) - 1
    a.delete()
    b.delete()


def test_cli_lists_shows_and_deletes_runs(client, trainer, session_id, capsys):
    from strop.cli.main import main

    run = client.create_training_run(session_id, RunLora(rank=2, seed=0), name="cli-run")
    target = ["--target", f"127.0.0.1:{trainer[0].port}"]
    assert main(["runs", "list", "--session", session_id, *target]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(run.run_id))
    assert "rank=2" in line and "steps=0" in line and line.endswith("cli-run")
    assert main(["runs", "show", run.run_id, *target]) == 0
    assert f'"run_id": "{run.run_id}"' in capsys.readouterr().out
    assert main(["runs", "delete", run.run_id, *target]) == 0
    capsys.readouterr()
    assert main(["runs", "show", run.run_id, *target]) == 1  # NOT_FOUND, reported on stderr
    assert "NOT_FOUND" in capsys.readouterr().err


def test_an_idle_run_is_offloaded_and_restored_on_use(client, trainer, session_id, runs_core, monkeypatch):
    monkeypatch.setattr(runs_core, "idle_offload_seconds", 0.2)
    monkeypatch.setattr(
        runs_core, "_offload_same_device", True
    )  # the CPU session: the bookkeeping, moved to itself
    monkeypatch.setattr(runs_core, "sweep_seconds", 0.2)
    idle = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    idle.forward_backward([ce_datum(SEQ2)])
    busy = client.create_training_run(session_id, RunLora(rank=2, seed=1))
    busy.forward([ce_datum(SEQ2)])  # the active adapter now: it is never offloaded
    import time

    deadline = time.monotonic() + 30
    while not runs_core._runs[idle.run_id].offloaded and time.monotonic() < deadline:
        time.sleep(0.2)
    assert runs_core._runs[idle.run_id].offloaded and not runs_core._runs[busy.run_id].offloaded
    stats = idle.optim_step(AdamParams(learning_rate=1e-3))  # its gradients came back with it
    assert stats.metrics and not runs_core._runs[idle.run_id].offloaded
    idle.delete()
    busy.delete()


def test_closing_the_session_deletes_its_runs_and_cancels_their_futures(client):
    s = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    run = client.create_training_run(s.session_id, RunLora(rank=2, seed=0))
    waiting = run.forward_backward_async([ce_datum(SEQ2)], seq_id=5)  # behind a hole: still pending
    with pytest.raises(FailedPreconditionError, match="holds training runs"):
        client.attach_lora(s.session_id)
    client.close_session(s.session_id)
    assert client.get_future(waiting.future_id).state.value == "CANCELLED"
    with pytest.raises(NotFoundError):
        client.get_training_run(run.run_id)


def test_a_full_queue_is_resource_exhausted_and_accepts_again_once_drained(
    client, session_id, runs_core, monkeypatch
):
    from strop.client import ResourceExhaustedError

    monkeypatch.setattr(runs_core, "max_pending_per_run", 2)
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    held = [run.forward_async([ce_datum(SEQ2)], seq_id=s) for s in (3, 4)]  # behind a hole at 1, 2: pending
    with pytest.raises(ResourceExhaustedError, match="2 futures pending"):
        run.forward_async([ce_datum(SEQ2)], seq_id=5)
    for f in held:
        f.cancel()
    assert run.forward_async([ce_datum(SEQ2)], seq_id=1).result(timeout=60).loss_fn_outputs  # room again
    run.delete()


def test_the_fused_kernels_compute_with_whichever_run_is_active(client, caplog):
    """Two runs on a session with strop's kernels patched in (the Triton interpreter on the CPU) give the log-probs
    and gradients the same runs give on an unpatched session, alternating primitives between them: the kernels read
    the active run's adapter on every call."""
    from strop.common.trainer_types import KernelMode

    patched = client.load_model(
        "tiny-llama", quantization=Quantization.NONE, dtype="float32", kernels=KernelMode.ON
    )
    plain = client.load_model(
        "tiny-llama", quantization=Quantization.NONE, dtype="float32", kernels=KernelMode.OFF
    )
    assert patched.facts.kernels_enabled and not plain.facts.kernels_enabled
    out = {}
    for sess in (patched, plain):
        runs = [client.create_training_run(sess.session_id, RunLora(rank=4, seed=s)) for s in (11, 12)]
        for run, seq in zip(runs, (SEQ, SEQ2), strict=True):
            run.forward_backward([ce_datum(seq)])
            run.optim_step(AdamParams(learning_rate=1e-2))
        # alternate: a, b, a on the same sequence (a stale adapter would show as b's numbers in a's place)
        out[sess.session_id] = [
            runs[i].forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs for i in (0, 1, 0)
        ]
        assert out[sess.session_id][0] != out[sess.session_id][1]
    # fp32 kernels against torch: ≈1e-5 relative (DESIGN.md's fp32 bound), here over two training steps
    for got, want in zip(out[patched.session_id], out[plain.session_id], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    # the patched path really ran (its rounding differs from torch's somewhere), with no fallback to PEFT's
    assert out[patched.session_id] != out[plain.session_id]
    fallbacks = [r.getMessage() for r in caplog.records if "reference path for" in r.getMessage()]
    assert not fallbacks, fallbacks
    logging.getLogger("strop.kernels").warning(
        "strop.kernels: reference path for probe"
    )  # the check can see one
    assert any("reference path for probe" in r.getMessage() for r in caplog.records)
    client.close_session(patched.session_id)
    client.close_session(plain.session_id)


@pytest.mark.gpu
def test_step_api_on_cuda_with_the_kernels_on_an_nf4_base(client, trainer):
    """GPU tier: a 4-bit session (kernels on by default on CUDA, bf16 compute) trains two runs through the step
    API, each ForwardBackward under the jobs' default memory mode: the loss falls, the runs stay apart, and a run
    reloaded from its state continues bit for bit on the device."""
    s = client.load_model("tiny-llama-4bit")
    assert s.facts.device.startswith("cuda") and s.facts.kernels_enabled
    a = client.create_training_run(s.session_id, RunLora(rank=8, seed=0))
    b = client.create_training_run(s.session_id, RunLora(rank=8, seed=1))
    b_before = b.forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs
    losses = []
    for _ in range(10):
        losses.append(a.forward_backward([ce_datum(SEQ)]).metrics[0].value)
        a.optim_step(AdamParams(learning_rate=3e-3))
    assert losses[-1] < 0.8 * losses[0], losses
    report = _loaded(trainer, s.session_id).extra["step_memory_mode"]
    assert "memory mode STANDARD" in report and "offload_activations: on" in report, report
    b_after = (
        b.forward([ce_datum(SEQ2)]).loss_fn_outputs[0].logprobs
    )  # b untouched: a's steps move lp by > 1e-3
    torch.testing.assert_close(torch.tensor(b_after), torch.tensor(b_before), rtol=0, atol=1e-6)
    saved = a.save_state("gpu-step-state")
    for _ in range(2):
        a.forward_backward([ce_datum(SEQ2)])
        a.optim_step(AdamParams(learning_rate=3e-3))
    want = a.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs
    c = client.create_training_run(s.session_id, from_state=saved.artifact_id)
    for _ in range(2):
        c.forward_backward([ce_datum(SEQ2)])
        c.optim_step(AdamParams(learning_rate=3e-3))
    assert c.forward([ce_datum(SEQ)]).loss_fn_outputs[0].logprobs == want
    client.close_session(s.session_id)


def test_cross_entropy_over_k_candidates_scores_each_like_its_own_column(client, session_id):
    """[N, K] target_tokens and weights (Tinker's top-K distillation form): each candidate's log-prob equals the
    one a [N] datum of that column gets, and the loss is −Σ w·lp over all N·K."""
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    tokens = SEQ2[:-1]
    cands = [[t, (t + 1) % 640, (t * 7) % 640] for t in SEQ2[1:]]
    weights = [[0.6, 0.3, 0.1]] * len(cands)
    out = run.forward([Datum.of(tokens, target_tokens=cands, weights=weights)])
    lp = torch.tensor(out.loss_fn_outputs[0].logprobs).reshape(len(cands), 3)
    for j in range(3):
        col = run.forward([Datum.of(tokens, target_tokens=[c[j] for c in cands], weights=[1.0] * len(cands))])
        torch.testing.assert_close(
            lp[:, j], torch.tensor(col.loss_fn_outputs[0].logprobs), rtol=1e-6, atol=1e-6
        )
    want = -(lp * torch.tensor(weights)).sum().item()
    assert out.metrics[0].value == pytest.approx(want, rel=1e-5)
    with pytest.raises(InvalidArgumentError, match=r"expected \[10, 3\]"):
        run.forward([Datum.of(tokens, target_tokens=cands, weights=[1.0] * len(cands))])
    run.delete()


@pytest.fixture(scope="module")
def tenants(model_root, tmp_path_factory):
    """A trainer with bearer tokens for two tenants and an admin, over real gRPC."""
    import json

    from strop.common.auth import TokenTable
    from strop.common.grpc_server import Security
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = tmp_path_factory.mktemp("step-tenants")
    tokens = work / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"tenant": "team-a", "token": "ta"},
                    {"tenant": "team-b", "token": "tb"},
                    {"tenant": "ops", "token": "admin", "role": "admin"},
                ]
            }
        )
    )
    service = start(
        TrainerConfig(
            model_root=model_root,
            artifact_root=work / "artifacts",
            state_dir=work / "state",
            step_hole_seconds=0.5,
        ),
        security=Security(tokens=TokenTable.load(tokens)),
    )
    target = f"127.0.0.1:{service.port}"
    with (
        TrainerClient(target, token="ta") as a,
        TrainerClient(target, token="tb") as b,
        TrainerClient(target, token="admin") as ops,
    ):
        yield a, b, ops
    service.stop(grace=10.0)


def test_many_tenants_train_runs_on_one_shared_session_and_see_only_their_own(tenants):
    """An admin loads a shared base; two tenants create runs on it and train, each seeing only its own runs and
    futures; only the owner (or an admin) may close it or use it otherwise; closing it ends every tenant's runs."""
    from strop.client import PermissionDeniedError

    a, b, ops = tenants
    with pytest.raises(PermissionDeniedError, match="only an admin may load a shared session"):
        a.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32", shared=True)
    shared = ops.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32", shared=True)
    sid = shared.session_id
    assert shared.shared and shared.tenant == "ops"
    # every tenant sees the shared session (to create runs on it)
    assert sid in [s.session_id for s in a.list_sessions()] and b.get_session(sid).shared
    run_a = a.create_training_run(sid, RunLora(rank=2, seed=1))
    run_b = b.create_training_run(sid, RunLora(rank=2, seed=2))
    assert (run_a.info.tenant, run_b.info.tenant) == ("team-a", "team-b")
    fut_a = run_a.forward_backward_async([ce_datum(SEQ)])
    loss_b = run_b.forward_backward([ce_datum(SEQ2)]).metrics[0].value
    loss_a = fut_a.result(timeout=60).metrics[0].value
    run_a.optim_step(AdamParams(learning_rate=1e-2))
    run_b.optim_step(AdamParams(learning_rate=1e-2))
    # one more step of each lowers its own loss: both really trained on the one base
    assert run_a.forward([ce_datum(SEQ)]).metrics[0].value < loss_a
    assert run_b.forward([ce_datum(SEQ2)]).metrics[0].value < loss_b
    # each tenant lists only its own runs on the shared session; the admin sees both
    assert [r.run_id for r in a.list_training_runs(sid)] == [run_a.run_id]
    assert [r.run_id for r in b.list_training_runs(sid)] == [run_b.run_id]
    assert {r.run_id for r in ops.list_training_runs(sid)} == {run_a.run_id, run_b.run_id}
    # another tenant's run and future are NOT_FOUND, as for ids that do not exist
    with pytest.raises(NotFoundError):
        b.get_training_run(run_a.run_id)
    with pytest.raises(NotFoundError):
        b.get_future(fut_a.future_id)
    with pytest.raises(NotFoundError):
        b.delete_training_run(run_a.run_id)
    # the session's own calls are its owner's: another tenant sees it but may not close or change it
    with pytest.raises(PermissionDeniedError, match="only its owner or an admin"):
        b.close_session(sid)
    with pytest.raises(PermissionDeniedError, match="only its owner or an admin"):
        a.attach_lora(sid)
    # a tenant's own (not shared) session stays invisible to the other tenant, runs included
    own = a.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    assert own.session_id not in [s.session_id for s in b.list_sessions()]
    with pytest.raises(NotFoundError):
        b.create_training_run(own.session_id, RunLora(rank=2, seed=0))
    a.close_session(own.session_id)
    # the owner closes the shared session: every tenant's runs on it go
    ops.close_session(sid)
    with pytest.raises(NotFoundError):
        a.get_training_run(run_a.run_id)
    with pytest.raises(NotFoundError):
        b.get_training_run(run_b.run_id)


def test_a_sample_of_the_live_run_sees_every_primitive_submitted_before_it(client, trainer, session_id):
    """Sample(run) is ordered with the run's training primitives (Tinker's per-run order): submitted behind
    three ForwardBackward + OptimStep rounds, it samples with the weights after all three. The worker is held
    (the session's lock) while everything is submitted, so without the order the sample queue's turn would come
    after at most one primitive, before any update."""
    run = client.create_training_run(session_id, RunLora(rank=4, seed=21))
    prompt = SEQ[:8]
    prompt_datum = Datum.of(prompt[:-1], target_tokens=prompt[1:], weights=[0.0] * 7)
    before = torch.tensor(run.forward([prompt_datum]).loss_fn_outputs[0].logprobs)
    lock = trainer[1].sessions.open(session_id).lock
    with lock:
        for _ in range(3):
            run.forward_backward_async([ce_datum(SEQ)])
            run.optim_step_async(AdamParams(learning_rate=3e-2))
        sampled = run.sample_async(prompt, 2, SamplingParams(max_tokens=2, seed=1), prompt_logprobs=True)
    out = sampled.result(timeout=120)
    after = torch.tensor(run.forward([prompt_datum]).loss_fn_outputs[0].logprobs)
    got = torch.tensor(out.prompt_logprobs[1:])
    assert run.refresh().step == 3
    # three Adam steps at lr 3e-2 on these very tokens move their log-probs by nats; the sampler's prompt
    # log-probs are the updated weights' up to fp32 rounding (1e-5, as in the test above)
    assert (after - before).abs().max() > 0.1
    torch.testing.assert_close(got, after, rtol=1e-5, atol=1e-5)
    run.delete()


def test_the_seq_hole_timeout_is_a_server_setting(tenants):
    """``--step-hole-seconds`` (TrainerConfig.step_hole_seconds): this trainer skips a missing seq after 0.5 s, so
    a primitive behind a hole at seqs 1 and 2 runs within seconds (the default would hold it for 60 s)."""
    from strop.trainer_svc.server import parse_args

    assert parse_args(["--step-hole-seconds", "2.5"]).step_hole_seconds == 2.5
    assert parse_args([]).step_hole_seconds == 60.0
    with pytest.raises(SystemExit):
        parse_args(["--step-hole-seconds", "0"])
    a, _, _ = tenants
    s = a.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    run = a.create_training_run(s.session_id, RunLora(rank=2, seed=0))
    behind = run.forward_async([ce_datum(SEQ2)], seq_id=3)
    assert behind.result(timeout=15).metrics[0].name == "loss:sum"
    a.close_session(s.session_id)


def test_forward_backward_under_the_jobs_memory_mode_equals_it_without(client, trainer, monkeypatch):
    """The jobs' default memory mode (layer inputs offloaded, ``apply_memory_mode``) around a ForwardBackward on a
    session holding several runs: exercised here with CPU tensors (the offload path with ``offload_cpu_tensors``,
    nothing too small to move), it offloads the layer inputs and gives the same update as the plain path (the
    same ops, recomputed in backward from exact copies: equal to fp32 rounding), and it is gone afterwards."""
    s = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    loaded = _loaded(trainer, s.session_id)
    plain = client.create_training_run(s.session_id, RunLora(rank=4, seed=5))
    other = client.create_training_run(s.session_id, RunLora(rank=2, seed=6))  # a third adapter on the model
    moded = client.create_training_run(s.session_id, RunLora(rank=4, seed=5))
    data = [ce_datum(SEQ), ce_datum(SEQ2)]
    plain.forward_backward(data)
    plain.optim_step(AdamParams(learning_rate=1e-2))
    assert "step_memory_mode" not in loaded.extra  # CPU: the plain path, as the jobs
    monkeypatch.setattr(
        step_ops, "_MEMORY_MODE_ON_CPU", {"offload_cpu_tensors": True, "min_offload_bytes": 0}
    )
    out = moded.forward_backward(data)
    moded.optim_step(AdamParams(learning_rate=1e-2))
    other.forward_backward([ce_datum(SEQ2)])
    report = loaded.extra["step_memory_mode"]
    layers = loaded.model.get_base_model().config.num_hidden_layers
    # every layer's input but the last one's (backward needs it first, so it stays on the device)
    assert "memory mode STANDARD" in report and f"on: {layers - 1} inputs offloaded" in report, report
    assert not hasattr(loaded.model.get_base_model(), "_strop_offload")  # removed after the primitive
    want = _state(trainer, s.session_id, plain.run_id)
    got = _state(trainer, s.session_id, moded.run_id)
    # fp32 on a 2-layer model: the recompute repeats the forward's ops exactly; 1e-7 leaves room for a
    # differently ordered reduction
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-7)
    assert out.metrics[0].value == pytest.approx(plain.forward(data).metrics[0].value, rel=0.2)
    client.close_session(s.session_id)


def test_a_training_step_drops_generates_copies_and_a_forward_only_call_keeps_them(
    client, trainer, session_id
):
    """As a job does when it starts: a ForwardBackward frees the copies Generate keeps on a CPU session (its
    dequantized 4-bit layers, its fp32 head), which training does not compute from; a forward-only call keeps them."""
    from strop.trainer_svc.core import generation

    loaded = _loaded(trainer, session_id)
    run = client.create_training_run(session_id, RunLora(rank=2, seed=0))
    kept = {generation.INFERENCE_COPY: {}, generation.INFERENCE_HEAD: ("key", torch.zeros(1))}
    try:
        loaded.extra.update(kept)
        run.forward([ce_datum(SEQ)], "cross_entropy")
        assert kept.keys() <= loaded.extra.keys()
        run.forward_backward([ce_datum(SEQ)], "cross_entropy")
        assert not kept.keys() & loaded.extra.keys()
    finally:
        for k in kept:
            loaded.extra.pop(k, None)
        run.delete()
