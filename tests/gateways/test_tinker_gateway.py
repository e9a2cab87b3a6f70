"""The official ``tinker`` SDK (0.38.0, pinned) against the real gateway and a real trainer on 127.0.0.1 (a tiny
fp32 Llama): every response the SDK reads is validated by its own strict pydantic models or parsed by its own
protobuf module, so a disagreement between the pinned SDK and the server fails these tests."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
from tests.deps import locked

tinker = locked("tinker")
from tinker import types  # noqa: E402

from tests.gateways.conftest import KEY_A, KEY_B  # noqa: E402

SEQ = list(range(40, 61))  # 21 tokens of the tiny vocabulary (640)
SEQ2 = [7, 9, 300, 12, 500, 33, 1, 2, 3, 99, 100]


def datum(tokens, weights=None) -> types.Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": w},
    )


@pytest.fixture(scope="module")
def sc_a(tinker_stack):
    sc = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_A)
    yield sc


@pytest.fixture(scope="module")
def sc_b(tinker_stack):
    sc = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_B)
    yield sc


def test_the_pinned_sdk():
    assert tinker.__version__ == "0.38.0"


def test_capabilities_list_the_model_root(tinker_stack):
    rest = tinker.RestClient(base_url=tinker_stack[0], api_key=KEY_A)
    caps = rest.get_server_capabilities().result()
    assert {m.model_name for m in caps.supported_models} == {"tiny-llama", "tiny-llama-4bit"}


def test_training_loop_loss_falls_and_sums(sc_a, model_root):
    tc = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
    info = tc.get_info()
    assert info.model_data.tokenizer_id == str(model_root / "tiny-llama") and info.lora_rank == 4
    weights = [0.5 * (i % 3) for i in range(len(SEQ) - 1)]  # real weights, some 0
    data = [datum(SEQ, weights), datum(SEQ2)]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy").result()
        stats = tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        assert {"grad_norm:mean", "learning_rate:mean"} <= set(stats.metrics)
        # the loss is the sum −Σ w·lp over tokens and datums (Tinker's definition), from the returned log-probs
        lps = [o["logprobs"].tolist() for o in fb.loss_fn_outputs]
        assert [len(x) for x in lps] == [len(SEQ) - 1, len(SEQ2) - 1]
        by_hand = -sum(lp * w for lp, w in zip(lps[0], weights, strict=True)) - sum(lps[1])
        # fp32 log-probs summed over 30 tokens of magnitude ≤ ~7: 1e-4 relative is far above rounding
        assert fb.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-4)
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses


def test_sampling_client_tokens_and_logprobs_match_forward(sc_a):
    tc = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=1).result()
    for _ in range(2):
        tc.forward_backward([datum(SEQ)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQ[:6]
    r = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5, seed=3),
        include_prompt_logprobs=True,
    ).result()
    assert len(r.sequences) == 2
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    for s in r.sequences:
        assert 1 <= len(s.tokens) <= 5 and len(s.logprobs) == len(s.tokens)
        assert s.stop_reason in ("stop", "length")
        # the snapshot is the run's weights (nothing trained since): forward's log-probs of the sampled tokens
        full = prompt + list(s.tokens)
        fwd = tc.forward([datum(full, [1.0] * (len(full) - 1))], "cross_entropy").result()
        want = fwd.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        # fp32, batched KV-cache decoding vs one full forward of ≤ 11 tokens: agree to ~1e-6
        assert s.logprobs == pytest.approx(want, abs=1e-4)
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
    # prompt log-probs are forward's too
    fwd = tc.forward([datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert r.prompt_logprobs[1:] == pytest.approx(fwd, abs=1e-4)


def test_save_state_and_load_state_continue_exactly(sc_a, tinker_stack):
    adam = types.AdamParams(learning_rate=3e-3, eps=1e-8)
    tc = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=2).result()
    for _ in range(2):
        tc.forward_backward([datum(SEQ)], "cross_entropy").result()
        tc.optim_step(adam).result()
    path = tc.save_state("s1").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/s1")

    def two_more(client):
        out = []
        for _ in range(2):
            out.append(client.forward_backward([datum(SEQ2)], "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(adam).result()
        out.append(client.forward([datum(SEQ2)], "cross_entropy").result().metrics["loss:sum"])
        return out

    want = two_more(tc)
    loaded = sc_a.create_training_client_from_state_with_optimizer(path).result()
    assert two_more(loaded) == want  # bit for bit on the same device
    # without the optimizer: the same weights, Adam restarts (the first loss equal, the next ones not)
    fresh = sc_a.create_training_client_from_state(path).result()
    got = two_more(fresh)
    assert got[0] == want[0] and got[1] != want[1]
    # the deprecated in-place form reaches the same state
    tc.load_state_with_optimizer(path).result()
    assert two_more(tc) == want

    rest = tinker.RestClient(base_url=tinker_stack[0], api_key=KEY_A)
    cps = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in cps] == [
        ("weights/s1", "training", path)
    ]
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.last_checkpoint.tinker_path == path
    rest.delete_checkpoint(tc.model_id, "weights/s1").result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_two_api_keys_are_isolated(sc_a, sc_b, tinker_stack):
    tc = sc_a.create_lora_training_client("tiny-llama", rank=2, seed=4).result()
    tc.forward_backward([datum(SEQ)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("mine").result().path
    rest_b = tinker.RestClient(base_url=tinker_stack[0], api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        rest_b.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_training_run(tc.model_id).result()
    assert tc.model_id not in {r.training_run_id for r in rest_b.list_training_runs().result().training_runs}
    assert tc.model_id in {
        r.training_run_id
        for r in tinker.RestClient(base_url=tinker_stack[0], api_key=KEY_A)
        .list_training_runs()
        .result()
        .training_runs
    }
    with pytest.raises(tinker.NotFoundError):  # the trainer hides tenant a's artifact from tenant b
        sc_b.create_training_client_from_state(path).result()
    # b trains its own run on the same base, untouched by a's
    tb = sc_b.create_lora_training_client("tiny-llama", rank=2, seed=4).result()
    lb = tb.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    la = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    assert lb != la  # a's run moved, b's is fresh


def test_errors_surface_as_the_sdks_exceptions(sc_a, tinker_stack):
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        sc_a.create_lora_training_client("no-such-model", rank=2).result()
    tc = sc_a.create_lora_training_client("tiny-llama", rank=2, seed=5).result()
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        tc.forward_backward([datum(SEQ)], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="weights"):  # an input cross_entropy lacks, named
        bad = types.Datum(
            model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs={"target_tokens": SEQ[1:]}
        )
        tc.forward_backward([bad], "cross_entropy").result()
    # a failure found when the primitive runs: the future fails with the user category
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert info.value.category == types.RequestErrorCategory.User and "gradients" in str(info.value)
    # the failed seq still advances: the client goes on
    assert tc.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.AuthenticationError):  # a tml- key the trainer does not know
        tinker.ServiceClient(base_url=tinker_stack[0], api_key="tml-unknown").create_lora_training_client(
            "tiny-llama", rank=2
        ).result()


def test_sampling_from_a_sampler_path_and_from_the_base(sc_a, tinker_stack):
    tc = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=6).result()
    for _ in range(3):
        tc.forward_backward([datum(SEQ)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("smp1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/smp1"
    prompt = types.ModelInput.from_ints(SEQ[:6])
    params = types.SamplingParams(max_tokens=1)

    def prompt_lps(client):
        r = client.sample(prompt, 1, params, include_prompt_logprobs=True).result()
        return r.prompt_logprobs[1:]

    trained = prompt_lps(sc_a.create_sampling_client(model_path=path))
    want = tc.forward([datum(SEQ[:6])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert trained == pytest.approx(want, abs=1e-4)
    # the base model: the same prompt scored without the adapter differs from the trained run's
    base = prompt_lps(sc_a.create_sampling_client(base_model="tiny-llama"))
    assert max(abs(a - b) for a, b in zip(base, trained, strict=True)) > 1e-2
    fresh = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=7).result()  # B = 0: the base exactly
    want_base = (
        fresh.forward([datum(SEQ[:6])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )
    assert base == pytest.approx(want_base, abs=1e-4)
    rest = tinker.RestClient(base_url=tinker_stack[0], api_key=KEY_A)
    cps = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in cps] == [("sampler_weights/smp1", "sampler")]
    with pytest.raises(tinker.NotFoundError):  # another key cannot sample it
        sb = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_B).create_sampling_client(
            model_path=path
        )
        sb.sample(prompt, 1, params).result()


def test_malformed_requests_get_a_status_and_a_body_never_a_500(tinker_stack):
    import httpx

    url = tinker_stack[0] + "/api/v1"
    h = {"X-API-Key": KEY_A}
    with httpx.Client(timeout=30) as c:
        cases = [
            (c.post(f"{url}/create_model", content=b"{not json", headers=h), 400),
            (c.post(f"{url}/create_model", json={"base_model": "tiny-llama"}, headers=h), 400),  # no session
            (c.post(f"{url}/create_session", json={}), 401),  # no key
            (c.post(f"{url}/create_session", json={}, headers={"X-API-Key": "sk-other"}), 401),
            (
                c.post(
                    f"{url}/forward_backward",
                    content=b"\xff\xff",
                    headers={**h, "Content-Type": "application/x-protobuf"},
                ),
                400,
            ),
            (
                c.post(
                    f"{url}/forward_backward",
                    content=b"\x28\xb5\x2f\xfd junk",
                    headers={**h, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
                ),
                400,
            ),
            (c.post(f"{url}/retrieve_future", json={"request_id": "tkf-nope"}, headers=h), 404),
            (c.post(f"{url}/get_info", json={"model_id": "nope:train:0"}, headers=h), 404),
            (c.get(f"{url}/training_runs?limit=-1", headers=h), 400),
            (c.post(f"{url}/weights_info", json={"tinker_path": "s3://x"}, headers=h), 400),
            (c.delete(f"{url}/training_runs/nope:train:0/checkpoints/weights/x", headers=h), 404),
        ]
    for resp, status in cases:
        assert resp.status_code == status, (resp.request.url, resp.text)
        assert resp.json()["detail"], resp.text
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}


def test_a_chunked_forward_backward_sums_exactly(sc_a, tinker_stack):
    """Five datums with chunks of two (the gateway's client config): the SDK sends three requests concurrently,
    each its own seq; the trainer runs them in seq order and sums their gradients, so one optim_step after them
    equals a twin run's after five one-datum calls."""
    data = [datum(SEQ), datum(SEQ2), datum(SEQ[3:15]), datum(SEQ2[::-1]), datum([5, 6, 7, 8, 9, 10])]
    adam = types.AdamParams(learning_rate=1e-2)
    chunked = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=8).result()
    single = sc_a.create_lora_training_client("tiny-llama", rank=4, seed=8).result()
    fb = chunked.forward_backward(data, "cross_entropy").result()
    assert len(fb.loss_fn_outputs) == 5
    from strop.client import TrainerClient

    trainer = f"127.0.0.1:{tinker_stack[2].running.port}"
    with TrainerClient(trainer, token=KEY_A) as tc:  # the trainer counts the run's primitives
        run = next(r for r in tc.list_training_runs() if r.name == chunked.model_id)
    assert {m.name: m.value for m in run.counts}.get("forward_backward") == 3  # it was split: 2 + 2 + 1
    per = [single.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] for d in data]
    assert fb.metrics["loss:sum"] == pytest.approx(sum(per), rel=1e-6)  # the SDK's "sum" merge of the chunks
    chunked.optim_step(adam).result()
    single.optim_step(adam).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (chunked, single)]
    # the same gradient summed in another order (fp32): Adam's first step moves each weight by ~lr·sign(g),
    # so only where |g| is at rounding level can the two differ; the losses agree to 1e-5 relative
    assert after[0] == pytest.approx(after[1], rel=1e-5)
    assert after[0] < 0.95 * fb.metrics["loss:sum"]
