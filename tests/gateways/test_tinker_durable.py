"""The Tinker gateway on shared bases, and with no state of its own: the official SDK against the real gateway and
trainer (tinker_stack). Two API keys share one loaded base. A gateway restarted in the middle of the SDK's loop
answers every id the SDK holds (models, futures, samplers, checkpoints), and the loop goes on exactly as without
the restart."""

from __future__ import annotations

import os
import urllib.request

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
from tests.deps import locked

tinker = locked("tinker")
from tinker import types  # noqa: E402

from tests.gateways.conftest import ADMIN, KEY_A, KEY_B, Served, free_port, gateway  # noqa: E402
from tests.gateways.test_tinker_gateway import SEQ, SEQ2, datum  # noqa: E402


def trainer_of(stack) -> str:
    return f"127.0.0.1:{stack[2].running.port}"


def test_two_keys_train_on_one_shared_base_and_see_only_their_own_runs(tinker_stack):
    from strop.client import TrainerClient

    url = tinker_stack[0]
    ta = (
        tinker.ServiceClient(base_url=url, api_key=KEY_A)
        .create_lora_training_client("tiny-llama", rank=2)
        .result()
    )
    tb = (
        tinker.ServiceClient(base_url=url, api_key=KEY_B)
        .create_lora_training_client("tiny-llama", rank=2)
        .result()
    )
    with (
        TrainerClient(trainer_of(tinker_stack), token=ADMIN) as admin,
        TrainerClient(trainer_of(tinker_stack), token=KEY_A) as a,
    ):
        bases = [s for s in admin.list_sessions() if s.facts.model_path == "tiny-llama"]
        # one base loaded, shared, owned by the gateway's admin token, whichever tenant came first
        assert len(bases) == 1 and bases[0].shared and bases[0].tenant == "ops"
        runs = {r.name: r for r in admin.list_training_runs(bases[0].session_id)}
        assert runs[ta.model_id].tenant == "a" and runs[tb.model_id].tenant == "b"
        # tenant a sees its own runs on it, never b's
        assert tb.model_id not in {r.name for r in a.list_training_runs(bases[0].session_id)}
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=url, api_key=KEY_B).get_training_run(ta.model_id).result()


def test_without_an_admin_token_an_unloaded_base_is_refused_with_how_to_fix_it(tinker_stack, model_root):
    # tiny-llama loaded shared by the gateway that holds the admin token (tiny-llama-4bit by nobody)
    tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_B).create_lora_training_client(
        "tiny-llama", rank=1
    ).result()
    served = Served(gateway(trainer_of(tinker_stack), model_root, admin_token=None), free_port())
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
        with pytest.raises(tinker.RequestFailedError, match="admin token"):  # tiny-llama-4bit: not loaded yet
            sc.create_lora_training_client("tiny-llama-4bit", rank=2).result()
        # a base loaded shared already needs no token
        tc = sc.create_lora_training_client("tiny-llama", rank=2, seed=1).result()
        assert tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        served.stop()


def test_a_gateway_restart_mid_loop_loses_nothing(tinker_stack, model_root):
    """A loop through a gateway that is stopped and started again (a new process's memory: a new Gateway) on the
    same address, with a forward_backward in flight, equals a twin loop through the gateway that never restarted,
    bit for bit; every id the SDK held before the restart is answered after it."""
    port = free_port()
    served = Served(gateway(trainer_of(tinker_stack), model_root), port)
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    twin = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_A)
    tc = sc.create_lora_training_client("tiny-llama", rank=4, seed=21).result()
    tw = twin.create_lora_training_client("tiny-llama", rank=4, seed=21).result()
    data, adam = [datum(SEQ), datum(SEQ2)], types.AdamParams(learning_rate=1e-2)

    def step(client):
        loss = client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        client.optim_step(adam).result()
        return loss

    losses = [step(tc) for _ in range(2)]
    twin_losses = [step(tw) for _ in range(4)]
    sampler = tc.save_weights_and_get_sampling_client().result()  # a sampling session id the SDK holds
    path = tc.save_weights_for_sampler("before").result().path
    state = tc.save_state("s1").result().path
    pending = tc.forward_backward(data, "cross_entropy")  # in flight across the restart
    # futures the SDK has not retrieved when the gateway stops: a trainer step (save_weights) and the gateway's own
    # work (create_model), through the SDK's HTTP calls
    import httpx

    h, v1 = {"X-API-Key": KEY_A}, f"{served.url}/api/v1"

    def retrieve(url, rid, headers=h):
        for _ in range(20):  # the SDK's poll: try_again until done
            got = httpx.post(f"{url}/retrieve_future", json={"request_id": rid}, headers=headers)
            if got.status_code != 200 or got.json().get("type") != "try_again":
                return got
        raise AssertionError("still pending")

    new = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    session = httpx.post(f"{v1}/create_session", json=new, headers=h).json()["session_id"]
    made = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 2}}
    rid = httpx.post(f"{v1}/create_model", json=made, headers=h).json()["request_id"]
    m0 = retrieve(v1, rid).json()["model_id"]
    save = {"model_id": m0, "path": "raw", "seq_id": 1}
    rid_save = httpx.post(f"{v1}/save_weights", json=save, headers=h).json()["request_id"]
    rid_make = httpx.post(f"{v1}/create_model", json={**made, "model_seq_id": 1}, headers=h).json()[
        "request_id"
    ]
    served.stop()
    served = Served(gateway(trainer_of(tinker_stack), model_root), port)
    try:
        losses.append(pending.result().metrics["loss:sum"])
        tc.optim_step(adam).result()
        losses.append(step(tc))
        assert losses == twin_losses  # the same loop, exactly: nothing was lost or repeated
        prompt = types.ModelInput.from_ints(SEQ[:5])
        out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        assert len(out.sequences[0].tokens) == 2
        after = (
            tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
            .create_sampling_client(model_path=path)
            .result()
        )
        assert len(after.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result().sequences) == 1
        rest = tinker.RestClient(base_url=served.url, api_key=KEY_A)
        assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints} >= {
            path,
            state,
        }
        assert tc.model_id in {
            r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
        }
        v1 = f"{served.url}/api/v1"
        assert retrieve(v1, rid_save).json() == {"path": f"tinker://{m0}/weights/raw"}
        m1 = f"{session}:train:1"
        assert retrieve(v1, rid_make).json() == {"model_id": m1, "type": "create_model"}
        assert retrieve(v1, rid).json() == {
            "model_id": m0,
            "type": "create_model",
        }  # answered again, the same
        from strop.client import TrainerClient

        with TrainerClient(trainer_of(tinker_stack), token=KEY_A) as a:  # each created once, not on a re-poll
            names = [r.name for r in a.list_training_runs()]
        assert names.count(m0) == 1 and names.count(m1) == 1
        # another key holding a's ids gets nothing
        assert retrieve(v1, rid_save, {"X-API-Key": KEY_B}).status_code == 404
    finally:
        served.stop()


def test_the_health_port_answers_liveness_and_readiness(tinker_stack):
    from strop.client import TrainerClient
    from strop.gateways.health import HealthServer, trainer_reachable

    def get(port, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode().strip()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode().strip()

    with TrainerClient(trainer_of(tinker_stack)) as up, TrainerClient(f"127.0.0.1:{free_port()}") as down:
        ok = HealthServer("127.0.0.1", 0, lambda: trainer_reachable(up)).start()
        bad = HealthServer("127.0.0.1", 0, lambda: trainer_reachable(down, timeout=0.2)).start()
        try:
            assert get(ok.port, "/healthz") == (200, "ok") and get(ok.port, "/readyz") == (200, "ready")
            status, why = get(bad.port, "/readyz")
            assert status == 503 and "not reachable" in why
            assert get(bad.port, "/healthz") == (200, "ok")  # liveness never depends on the trainer
            assert get(ok.port, "/api/v1/healthz")[0] == 404  # health only
            ok.draining()
            assert get(ok.port, "/readyz") == (503, "draining")
        finally:
            ok.stop()
            bad.stop()


def test_an_edited_id_is_not_found_never_a_500(tinker_stack):
    """The ids carry their payload in the clear: an edited one is the caller's own problem, answered 404."""
    import httpx

    from strop.gateways.common import owner_hash
    from strop.gateways.tinker import handles

    owner, h = owner_hash(KEY_A), {"X-API-Key": KEY_A}
    session = handles.new_session_id(owner)
    edited = [
        handles.encode(handles.FUTURE, owner, {"k": "create_model", "m": "not-a-model-id"}),
        handles.encode(handles.FUTURE, owner, {"k": "forward_backward", "f": "fut-none", "ks": [[1, 1]]}),
        handles.encode(
            handles.FUTURE,
            owner,
            {"k": "create_model", "m": f"{session}:train:0", "b": "tiny-llama", "l": {"no_such_field": 1}},
        ),
        handles.encode(handles.FUTURE, owner, {"k": "forward_backward", "f": 7, "ks": [[1, 10**12]]}),
        handles.encode(
            handles.FUTURE, handles.tag(owner_hash(KEY_B)) + "0" * 52, {"k": "optim_step", "f": "x"}
        ),
        f"tkf-{handles.tag(owner)}-%%%not-base64",
    ]
    url = f"{tinker_stack[0]}/api/v1/retrieve_future"
    for rid in edited:
        for _ in range(3):  # a local future's work may need a poll or two to fail
            r = httpx.post(url, json={"request_id": rid}, headers=h, timeout=30)
            if r.status_code != 200 or r.json().get("type") != "try_again":
                break
        assert r.status_code == 404, (rid, r.status_code, r.text)
    sampler = handles.encode(handles.SAMPLER, owner, {"s": 1, "r": [], "b": None})
    r = httpx.get(f"{tinker_stack[0]}/api/v1/samplers/{sampler}", headers=h, timeout=30)
    assert r.status_code == 404, r.text
