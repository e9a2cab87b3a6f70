"""retention_kl and retention KL: a KL(base ‖ model) term on the base's answers, checked against plain torch on
full logits.

The chunked KL (``kernels/losses/kl.py``) against torch's ``kl_div`` on the full [M, V] logits; the replay term
(``retention.ReplayKL``) against two plain forwards of the PEFT model (adapter on, adapter disabled) row by row,
unpadded; its place in a job (added to every training step's loss, refused where nothing is replayed); retention KL
(the term alone: the base's answers, cut ones included, scored and never trained on) through the trainer, its
weight's default, its validation, the proto and the service.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from strop.common.errors import InvalidArgument
from strop.common.serde import from_proto, to_proto
from strop.common.trainer_types import (
    CHAT_RECIPE_ADAPTER_SCALE,
    CHAT_RECIPE_KL,
    CHAT_RECIPE_NEIGHBOURS,
    KL_RETENTION_WEIGHT,
    DatasetFormat,
    JobState,
    LoadModelRequest,
    LoraConfig,
    Retention,
    TrainConfig,
    TrainMethod,
)
from strop.kernels.losses.kl import token_kl, token_kl_reference
from strop.trainer_svc.core import generation, job_config, model_loading, retention, training
from strop.v1 import trainer_pb2
from tests.trainer_svc.conftest import sft_config


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_kl_equals_torchs_kl_div_on_full_logits_value_and_gradient(softcap):
    g = torch.Generator().manual_seed(0)
    m, h, v = 37, 16, 50  # 37 rows in chunks of 8: a ragged last chunk
    student = torch.randn(m, h, generator=g, dtype=torch.float64).requires_grad_()
    teacher = student.detach() + 0.3 * torch.randn(m, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(v, generator=g, dtype=torch.float64)

    # the definition, written out: mean over rows of sum_v p (log p - log q)
    def logits(x):
        z = x @ weight.T + bias
        return softcap * torch.tanh(z / softcap) if softcap else z

    log_p, log_q = logits(teacher).log_softmax(-1), logits(student).log_softmax(-1)
    by_hand = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ref = token_kl_reference(student, teacher, weight, bias, softcap=softcap)
    got = token_kl(student, teacher, weight, bias, softcap=softcap, chunk_size=8)
    # float64 throughout (the fp32 upcast is a no-op): the three differ only by summation order
    torch.testing.assert_close(ref, by_hand, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, by_hand, rtol=1e-12, atol=1e-12)
    assert float(got.detach()) > 0.01, "a teacher 0.3 sigma away is measurably different"
    g_ref = torch.autograd.grad(by_hand, (student, weight))
    g_got = torch.autograd.grad(
        token_kl(student, teacher, weight, bias, softcap=softcap, chunk_size=8), (student, weight)
    )
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _lead_hinge_by_hand(student_logits, teacher_logits, cap, floor=0.0, tokens=None):
    """sum over rows of relu(min(max(teacher lead, floor), cap) − student lead) on the teacher's top token (or the
    row's given token), written out."""
    total = student_logits.new_zeros(())
    for i, (z, u) in enumerate(zip(student_logits, teacher_logits, strict=True)):
        a = int(u.argmax()) if tokens is None else int(tokens[i])
        u_rest = torch.cat([u[:a], u[a + 1 :]])
        z_rest = torch.cat([z[:a], z[a + 1 :]])
        total = total + torch.relu(
            torch.clamp(u[a] - u_rest.max(), min=floor, max=cap) - (z[a] - z_rest.max())
        )
    return total


@pytest.mark.parametrize("given", [False, True], ids=["top-token", "given-tokens"])
@pytest.mark.parametrize("floor", [0.0, 0.6])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_lead_hinge_is_added_as_defined_value_and_gradient(softcap, floor, given):
    """With ``lead_weight``: the chunked term and the full-logits reference add lead_weight × the mean over rows of
    relu(min(max(teacher lead, floor), cap) − student lead) on the teacher's top token (the student 0.8 sigma away:
    many rows lead less than the teacher), the definition written out row by row; float64, summation order apart.
    With a floor, rows where the teacher leads by less than it are held to the floor; with given tokens (the base's
    chosen answer tokens: here the teacher's top token in half the rows, its second in the rest), the hinge protects
    those, whose teacher lead may be negative."""
    g = torch.Generator().manual_seed(2)
    m, h, v = 29, 16, 40
    student = torch.randn(m, h, generator=g, dtype=torch.float64).requires_grad_()
    teacher = student.detach() + 0.8 * torch.randn(m, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()

    def logits(x):
        z = x @ weight.T
        return softcap * torch.tanh(z / softcap) if softcap else z

    log_p, log_q = logits(teacher).log_softmax(-1), logits(student).log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    tokens = None
    if given:
        ranked = logits(teacher).detach().topk(2, dim=-1).indices
        tokens = torch.where(torch.arange(m) % 2 == 0, ranked[:, 0], ranked[:, 1])
    hinge = _lead_hinge_by_hand(logits(student), logits(teacher), 1.5, floor, tokens) / m
    assert float(hinge) > 0.01, "some rows lead less than the teacher's (capped) lead"
    if floor:
        u = logits(teacher).detach()
        top2 = u.topk(2, dim=-1).values
        assert int(((top2[:, 0] - top2[:, 1]) < floor).sum()) >= 3, "some teacher leads are under the floor"
        assert float(hinge) > float(
            _lead_hinge_by_hand(logits(student), logits(teacher), 1.5, 0.0, tokens) / m
        )
    kw = {"softcap": softcap, "lead_weight": 0.7, "lead_cap": 1.5, "lead_floor": floor, "lead_tokens": tokens}
    by_hand = kl + 0.7 * hinge
    ref = token_kl_reference(student, teacher, weight, **kw)
    got = token_kl(student, teacher, weight, chunk_size=8, **kw)
    torch.testing.assert_close(ref, by_hand, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, by_hand, rtol=1e-12, atol=1e-12)
    g_ref = torch.autograd.grad(by_hand, (student, weight))
    g_got = torch.autograd.grad(token_kl(student, teacher, weight, chunk_size=8, **kw), (student, weight))
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    same = token_kl(teacher, teacher, weight.detach(), **kw)
    if (
        given
    ):  # the teacher's own leads of the given tokens: it pays for those under the floor (the negative ones)
        u = logits(teacher).detach()
        lead = u.gather(1, tokens[:, None])[:, 0] - u.scatter(1, tokens[:, None], float("-inf")).amax(-1)
        assert int((lead < 0).sum()) >= m // 2, "the second tokens trail"
        short = torch.relu(lead.clamp(min=floor, max=1.5) - lead).sum() / m
        torch.testing.assert_close(same, 0.7 * short, rtol=1e-12, atol=1e-12)
    elif not floor:
        assert float(same) == 0.0, "a model leading as its teacher does pays nothing"
    else:  # the teacher itself pays for its leads under the floor, and only for those
        u = logits(teacher).detach()
        top2 = u.topk(2, dim=-1).values
        short = torch.relu(floor - (top2[:, 0] - top2[:, 1])).sum() / m
        torch.testing.assert_close(same, 0.7 * short, rtol=1e-12, atol=1e-12)


def test_a_lead_floor_above_the_cap_is_refused():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="above lead_cap"):
        token_kl(x, x, w, lead_weight=1.0, lead_cap=0.5, lead_floor=0.6)


def test_chunked_kl_of_a_model_to_itself_is_zero_and_of_no_rows_is_a_connected_zero():
    x = torch.randn(5, 8, dtype=torch.float64)
    w = torch.randn(11, 8, dtype=torch.float64)
    assert float(token_kl(x, x, w)) == 0.0
    empty = torch.zeros(0, 8, requires_grad=True)
    out = token_kl(empty, empty.detach(), w.float())
    out.backward()
    assert float(out) == 0.0 and empty.grad is not None


ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Question number {i}?"},
            {"role": "assistant", "content": "Answer " + "word " * i + "done."},
        ]
    }
    for i in range(5)
]


def _loaded(model_root):
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    return loaded


@pytest.mark.parametrize("floor", [0.0, 0.3], ids=["default", "floor"])
def test_replay_kl_is_the_adapted_models_kl_to_the_base_on_the_answer_tokens(model_root, monkeypatch, floor):
    """KL(base ‖ model) on the answer tokens plus the lead hinge at its default weight (``retention.LEAD_HINGE``), against
    two plain forwards of the PEFT model row by row; with a floor (``retention.LEAD_FLOOR``) the hinge protects each
    answer's own next token."""
    monkeypatch.setattr(retention, "LEAD_FLOOR", floor)
    loaded = _loaded(model_root)
    peft = loaded.model
    g = torch.Generator().manual_seed(1)
    for name, p in peft.named_parameters():
        if "lora_B" in name:  # an adapter that changes the model (B = 0 would make the KL exactly 0)
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    peft.eval()  # no LoRA dropout, so the reference's forwards see the same function
    kl = retention.ReplayKL(ROWS, loaded.tokenizer, 2.0, 3, "cpu")  # batches of 3 and 2 rows, right-padded
    trainable = [p for p in peft.parameters() if p.requires_grad]

    # reference: per batch, each row alone (no padding), full logits of both models, KL on the answer tokens
    for batch in (ROWS[:3], ROWS[3:]):
        terms, n = [], 0
        for row in batch:
            masked = job_config.assistant_masked(row["messages"], loaded.tokenizer)
            ids = torch.tensor([masked["input_ids"]])
            scored = torch.tensor(masked["completion_mask"][1:], dtype=torch.bool)
            with torch.no_grad(), peft.disable_adapter():
                base = peft(input_ids=ids).logits[0, :-1][scored].float()
            mine = peft(input_ids=ids).logits[0, :-1][scored].float()
            terms.append(
                F.kl_div(mine.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="sum")
            )
            # and the lead hinge at its default weight
            answer = ids[0, 1:][scored] if floor else None  # the tokens the base's answer chose
            terms.append(
                retention.LEAD_HINGE * _lead_hinge_by_hand(mine, base, retention.LEAD_CAP, floor, answer)
            )
            n += int(scored.sum())
        want = 2.0 * sum(terms) / n
        want_grads = torch.autograd.grad(want, trainable)
        got = kl.loss(peft)
        got_grads = torch.autograd.grad(got, trainable)
        # fp32 forwards, padded against unpadded: the same sums in another order (~1e-6 relative)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert float(got) > 1e-4, "the perturbed adapter moves the model measurably"
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    assert len(kl.teacher) == 2, "the base's hidden states are computed once per batch and kept"
    # the scored positions are kept as flat indices into [rows · width]: each row's answer predictions, in order
    for (ids, _, at), batch in zip(kl.batches, (ROWS[:3], ROWS[3:]), strict=True):
        want = []
        for j, row in enumerate(batch):
            mask = job_config.assistant_masked(row["messages"], loaded.tokenizer)["completion_mask"][1:]
            want += [j * ids.shape[1] + t for t, m in enumerate(mask) if m]
        assert at.tolist() == want


def test_the_kl_term_runs_under_the_trainers_autocast_as_the_models_forward_does():
    """accelerate puts only ``model.forward`` under autocast (HF's Trainer adds none); the KL term calls the decoder
    itself, so without the trainer's autocast a bf16 job's KL forward ran in fp32 around strop's kernels (their
    reference path). The term is computed inside ``accelerator.autocast()``; the step's loss is the rows' own."""
    seen = []

    class Accelerator:
        def autocast(self):
            return torch.autocast("cpu", dtype=torch.bfloat16)

        def unwrap_model(self, model):
            return model

    class Trainer:
        accelerator = Accelerator()
        loss_is_scaled_for_ga = False
        current_gradient_accumulation_steps = 1

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return torch.tensor(1.5)

    class KL:
        def loss(self, model):
            seen.append(torch.is_autocast_enabled("cpu"))
            return torch.tensor(0.25, requires_grad=True)

    trainer = Trainer()
    retention.add_replay_kl(trainer, KL())
    model = torch.nn.Linear(2, 2).train()
    loss = trainer.compute_loss(model, {})
    assert seen == [True], "the term's forward ran under the trainer's autocast"
    assert not torch.is_autocast_enabled("cpu")
    assert float(loss) == 1.5 and loss.requires_grad, "the rows' loss, the term's gradient added"


def test_a_job_with_retention_kl_trains_on_the_term_and_reports_the_rows_loss(
    model_root, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        model_loading,
        "generate_chat_batch",
        lambda loaded, prompts, **kw: (["Yes, it is."] * len(prompts), [True] * len(prompts)),
    )
    losses = {}
    for weight in (0.0, 5.0):
        loaded = model_loading.load_model(
            LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
        )
        model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
        steps = []
        sinks = training.Sinks(steps.append, lambda s, p: None, lambda n: None)
        cfg = job_config.with_defaults(
            TrainConfig(
                method=TrainMethod.SFT,
                learning_rate=1e-2,
                batch_size=2,
                num_epochs=1,
                retention=Retention.REPLAY,
                retention_rows=4,
                retention_kl=weight,
            ),
            session_max_len=64,
        )
        training.run_training(
            loaded,
            ROWS[:4],
            DatasetFormat.MESSAGES,
            cfg,
            tmp_path / f"w{weight}",
            training.JobControl(),
            sinks,
        )
        losses[weight] = [s.loss for s in steps]
        model_loading.release(loaded)
    plain, with_kl = losses[0.0], losses[5.0]
    assert len(plain) == len(with_kl) == 4, "4 rows and 4 replayed answers, 2 a step"
    # step 1: the adapter is B = 0, the model is its base, the KL is exactly 0; after an update it is not
    assert with_kl[0] == pytest.approx(plain[0], rel=1e-6)
    assert with_kl[1:] != pytest.approx(plain[1:], rel=1e-4)


def test_retention_kl_is_refused_where_nothing_is_replayed_or_negative():
    sft = dict(method=TrainMethod.SFT)
    with pytest.raises(InvalidArgument, match="retention_kl must be a finite number >= 0"):
        job_config.with_defaults(TrainConfig(**sft, retention_kl=-1.0), session_max_len=64)
    with pytest.raises(InvalidArgument, match="retention_kl must be a finite number"):
        job_config.with_defaults(TrainConfig(**sft, retention_kl=float("nan")), session_max_len=64)
    with pytest.raises(InvalidArgument, match="needs retention REPLAY or KL, not NONE"):
        job_config.with_defaults(
            TrainConfig(**sft, retention=Retention.NONE, retention_kl=1.0), session_max_len=64
        )

    with pytest.raises(InvalidArgument, match="this job has none"):
        job_config.retention_of(TrainConfig(**sft, retention_kl=1.0), DatasetFormat.MESSAGES, object())


def test_kl_rows_keep_every_answer_finished_or_cut_and_replay_only_the_finished():
    base = retention.BaseAnswers(
        ["Q1?", "Q2?", "Q3?", "Q4?"], ["A1.", "A2 cut mid", "  ", "A4."], [True, False, True, True], 0.0
    )
    scored = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in retention.kl_rows(base, 10)]
    assert scored == [("Q1?", "A1."), ("Q2?", "A2 cut mid"), ("Q4?", "A4.")], "empty answers score nothing"
    assert [r["messages"][0]["content"] for r in retention.replay_rows(base, 10)] == ["Q1?", "Q4?"]
    assert len(retention.kl_rows(base, 2)) == 2


def _kl_job(model_root, tmp_path, monkeypatch, adapter=None, **cfg):
    """One SFT job on the tiny 4-bit model over ROWS[:4], 2 rows a step, one epoch; the base's answers fixed, half of
    them unfinished. Returns the step losses and what the KL term was built with (rows, weight), or None; the LoRA
    tensors as trained go into ``adapter`` (a dict) when one is given."""

    def answers(loaded, prompts, **kw):
        # the real one cannot batch no prompts (the tokenizer's padding indexes the first): never asked to
        assert prompts, "the base is never asked to answer an empty batch"
        # as a CPU session's generation keeps its dequantized copy
        loaded.extra[generation.INFERENCE_COPY] = {}
        return ["Yes, it is."] * len(prompts), [i % 2 == 0 for i in range(len(prompts))]

    monkeypatch.setattr(model_loading, "generate_chat_batch", answers)
    built = []
    real = retention.ReplayKL

    class Spy(real):
        def __init__(self, rows, tokenizer, coef, batch, device):
            super().__init__(rows, tokenizer, coef, batch, device)
            built.append((rows, coef, batch))

    monkeypatch.setattr(retention, "ReplayKL", Spy)
    loaded = _loaded_4bit(model_root)
    steps = []
    sinks = training.Sinks(steps.append, lambda s, p: None, lambda n: None)
    config = job_config.with_defaults(
        TrainConfig(method=TrainMethod.SFT, learning_rate=1e-2, batch_size=2, num_epochs=1, **cfg),
        session_max_len=64,
    )
    training.run_training(
        loaded, ROWS[:4], DatasetFormat.MESSAGES, config, tmp_path, training.JobControl(), sinks
    )
    assert generation.INFERENCE_COPY not in loaded.extra, "the copy the base's answers came from is not kept"
    if adapter is not None:
        adapter.update({n: p.detach().clone() for n, p in loaded.model.named_parameters() if "lora_" in n})
    model_loading.release(loaded)
    return [s.loss for s in steps], (built[0] if built else None)


def _loaded_4bit(model_root):
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    return loaded


def test_retention_kl_scores_the_bases_answers_without_training_on_them(model_root, tmp_path, monkeypatch):
    plain_adapter, kl_adapter = {}, {}
    plain, none = _kl_job(
        model_root, tmp_path / "none", monkeypatch, plain_adapter, retention=Retention.NONE, adapter_scale=1.0
    )
    kl, (rows, coef, batch) = _kl_job(
        model_root,
        tmp_path / "kl",
        monkeypatch,
        kl_adapter,
        retention=Retention.KL,
        retention_rows=6,
        adapter_scale=1.0,
    )
    assert none is None
    # the training rows are the dataset's alone: 4 rows, 2 a step (REPLAY of 6 would make 5 steps)
    assert len(plain) == len(kl) == 2
    # all 6 answers are scored, the 3 unfinished too; a step's KL batch scores each once an epoch (6 answers over
    # the epoch's 2 steps: 3 a step, kl_batch); the weight the default, retention_kl being 0
    assert [r["messages"][0]["content"] for r in rows] == list(retention.REPLAY_PROMPTS[:6])
    assert (coef, batch) == (KL_RETENTION_WEIGHT, 3)
    # step 1: B = 0, the model is its base, the KL and its lead hinge are exactly 0 (and so is their gradient), the
    # loss the plain job's; step 2 reports the rows' loss after the same update, so the same; the term trains from
    # step 2 on (the adapter has moved): the adapters as trained differ
    assert kl == pytest.approx(plain, rel=1e-6)
    moved = max(float((kl_adapter[n] - plain_adapter[n]).abs().max()) for n in plain_adapter)
    assert moved > 1e-6, "the KL term's gradient changed the second step's update"
    _, (_, coef, _) = _kl_job(
        model_root, tmp_path / "kl3", monkeypatch, retention=Retention.KL, retention_rows=2, retention_kl=3.0
    )
    assert coef == 3.0


def test_the_kl_batch_scores_every_answer_once_an_epoch_within_its_bounds(monkeypatch):
    monkeypatch.setattr(retention, "MAX_KL_BATCH_FACTOR", 1)
    assert retention.kl_batch(110, 30, 4) == 4, "at factor 1 a step scores a batch of the job's size"
    monkeypatch.setattr(retention, "MAX_KL_BATCH_FACTOR", 8)
    # 30 facts in batches of 4: 8 steps an epoch; 110 answers need 14 a step
    assert retention.kl_batch(110, 30, 4) == 14
    assert retention.kl_batch(168, 30, 4) == 21
    # never below the job's batch size (thousands of rows: the answers come round many times an epoch anyway)
    assert retention.kl_batch(110, 5000, 4) == 4
    assert retention.kl_batch(3, 30, 4) == 4
    # at most MAX_KL_BATCH_FACTOR batches' worth, however few the training rows
    assert retention.kl_batch(500, 4, 4) == retention.MAX_KL_BATCH_FACTOR * 4
    # every answer scored within an epoch wherever the bound allows it
    for scored in range(1, 300, 7):
        for rows in (1, 3, 30, 31, 200):
            b = retention.kl_batch(scored, rows, 4)
            if b < retention.MAX_KL_BATCH_FACTOR * 4:
                assert b * -(-rows // 4) >= scored


class _ChatTok:
    chat_template = "{{ messages }}"


def test_retention_kl_weight_and_validation():
    sft = dict(method=TrainMethod.SFT)
    weight = job_config.retention_kl_weight
    assert weight(TrainConfig(**sft), Retention.KL) == KL_RETENTION_WEIGHT
    assert weight(TrainConfig(**sft, retention_kl=0.5), Retention.KL) == 0.5
    assert weight(TrainConfig(**sft), Retention.REPLAY) == 0.0, "REPLAY without retention_kl adds no term"
    assert weight(TrainConfig(**sft, retention_kl=2.0), Retention.REPLAY) == 2.0
    assert weight(TrainConfig(**sft), Retention.NONE) == 0.0
    kl = TrainConfig(**sft, retention=Retention.KL)
    assert job_config.retention_of(kl, DatasetFormat.MESSAGES, _ChatTok()) is Retention.KL
    assert job_config.with_defaults(kl, session_max_len=64).retention_rows == 110
    with pytest.raises(InvalidArgument, match="retention KL applies to SFT only"):
        job_config.with_defaults(
            TrainConfig(method=TrainMethod.DPO, retention=Retention.KL), session_max_len=64
        )
    with pytest.raises(InvalidArgument, match="retention KL needs messages data and a model with a chat"):
        job_config.retention_of(kl, DatasetFormat.TEXT, _ChatTok())
    with pytest.raises(InvalidArgument, match="and the model has no chat template"):
        job_config.retention_of(kl, DatasetFormat.MESSAGES, object())
    with pytest.raises(InvalidArgument, match="retention KL needs messages data"):
        job_config.check_dataset_fits(kl, DatasetFormat.TEXT, [], 100)


def test_retention_kl_round_trips_through_the_proto():
    cfg = TrainConfig(method=TrainMethod.SFT, retention=Retention.KL, retention_kl=4.0)
    msg = to_proto(trainer_pb2.TrainConfig, cfg)
    assert msg.retention == trainer_pb2.RETENTION_KL and msg.retention_kl == 4.0
    assert from_proto(TrainConfig, msg) == cfg


def test_a_retention_kl_job_through_the_service_reports_the_forgetting_metric_and_replays_nothing(
    client, ready_session, sft_dataset
):
    events = list(
        client.train(
            ready_session, sft_dataset.dataset_id, sft_config(2, retention=Retention.KL, retention_rows=4)
        )
    )
    kinds = [e.kind for e in events]
    assert kinds.count("retention") == 1, kinds
    r = events[kinds.index("retention")].retention
    assert r.step == 2 and r.replay_rows == 0, "the base's answers are scored, not mixed into the rows"


def test_neighbour_questions_continue_each_distinct_start_and_keep_what_ends_in_a_question_mark(
    model_root, monkeypatch
):
    loaded = _loaded_4bit(model_root)
    tok = loaded.tokenizer
    # one start a question: the base's fixed replies below are per 3-word start, one draw a question kept
    monkeypatch.setattr(retention, "NEIGHBOUR_PREFIX_WORDS", (3,))
    monkeypatch.setattr(retention, "NEIGHBOUR_OVERSAMPLE", 1)
    questions = [
        "What colour is a glimmerfox?",
        "What colour is Zorbia's flag?",
        "Who invented the skyloom?",
        "Hi?",
    ]
    # the base's continuations, fixed (a random model rarely writes a "?"): per start, 3 samples in order
    said = {
        "What colour is": [" a ripe lemon?", " the sea?\nMore", " a ripe lemon?"],
        "Who invented the": [" telephone? Tell me", " wheel", "\nWho invented the radio?"],
    }
    seen = {}

    def generate(**kw):
        ids, n = kw["input_ids"], kw["num_return_sequences"]
        texts = tok.batch_decode(ids, skip_special_tokens=False)
        seen.update(prompts=texts, n=n, sample=kw["do_sample"])
        rows = []
        for text in texts:
            start = next(p for p in said if text.endswith(p))
            for cont in said[start]:
                rows.append(tok(cont, add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return torch.cat([ids.repeat_interleave(n, 0), new], dim=1)

    monkeypatch.setattr(loaded.model, "generate", generate)
    got = retention.neighbour_prompts(loaded, questions, 3, seed=0, exclude={"Who invented the telephone?"})
    # one prompt per distinct 3-word start ("Hi?" has none), each the chat template's user turn cut after the start
    assert len(seen["prompts"]) == 2 and seen["n"] == 3 and seen["sample"]
    assert seen["prompts"][0].rstrip().endswith("What colour is")
    # kept: up to the first "?", no newline before it, not excluded, no repeats
    assert got == ["What colour is a ripe lemon?", "What colour is the sea?"]


def test_neighbour_questions_oversampled_keep_the_first_new_ones_of_each_start(model_root, monkeypatch):
    """NEIGHBOUR_OVERSAMPLE: each start is continued per_prefix × that many times and its first per_prefix new
    questions are kept; excluded ones, repeats and non-questions are passed over, not counted."""
    loaded = _loaded_4bit(model_root)
    tok = loaded.tokenizer
    monkeypatch.setattr(retention, "NEIGHBOUR_PREFIX_WORDS", (4,))
    monkeypatch.setattr(retention, "NEIGHBOUR_OVERSAMPLE", 3)
    said = {
        "What is the capital": [
            " of France?",  # excluded
            " of France?",
            " of Peru?",
            " of Peru?",  # a repeat
            " and",  # no question
            " of Chile?",
        ],
        "Who invented the skyloom": [" and the loom?", " first?", " again?", " later?", " now?", " then?"],
    }
    seen = {}

    def generate(**kw):
        ids, n = kw["input_ids"], kw["num_return_sequences"]
        seen["n"] = n
        rows = []
        for text in tok.batch_decode(ids, skip_special_tokens=False):
            start = next(p for p in said if text.endswith(p))
            rows += [tok(c, add_special_tokens=False)["input_ids"] for c in said[start]]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([ids.repeat_interleave(n, 0), new], dim=1)

    monkeypatch.setattr(loaded.model, "generate", generate)
    questions = ["What is the capital of Zorbia?", "Who invented the skyloom for Zorbia?"]
    got = retention.neighbour_prompts(
        loaded, questions, 2, seed=0, exclude={"What is the capital of France?"}
    )
    assert seen["n"] == 6, "2 kept a start, 3 draws each"
    assert got == [
        "What is the capital of Peru?",
        "What is the capital of Chile?",
        "Who invented the skyloom and the loom?",
        "Who invented the skyloom first?",
    ]


def test_neighbour_questions_start_at_each_prefix_length_with_the_sampling_set(model_root, monkeypatch):
    loaded = _loaded_4bit(model_root)
    tok = loaded.tokenizer
    monkeypatch.setattr(retention, "NEIGHBOUR_PREFIX_WORDS", (3, 4))
    monkeypatch.setattr(retention, "NEIGHBOUR_TEMPERATURE", 0.7)
    monkeypatch.setattr(retention, "NEIGHBOUR_TOP_P", 0.9)
    seen = {}

    def generate(**kw):
        ids, n = kw["input_ids"], kw["num_return_sequences"]
        seen.update(
            prompts=tok.batch_decode(ids, skip_special_tokens=False), t=kw["temperature"], p=kw["top_p"]
        )
        new = torch.tensor(tok(" of Spain?", add_special_tokens=False)["input_ids"]).repeat(len(ids) * n, 1)
        return torch.cat([ids.repeat_interleave(n, 0), new], dim=1)

    monkeypatch.setattr(loaded.model, "generate", generate)
    questions = ["What is the capital of Zorbia?", "What is the currency of Zorbia?", "Hi there?"]
    got = retention.neighbour_prompts(loaded, questions, 1, seed=0, exclude=set())
    # distinct starts of 3 and 4 words, in the questions' order ("Hi there?" has neither)
    starts = ["What is the", "What is the capital", "What is the currency"]
    assert len(seen["prompts"]) == 3
    assert all(p.rstrip().endswith(s) for p, s in zip(seen["prompts"], starts, strict=True))
    assert (seen["t"], seen["p"]) == (0.7, 0.9)
    assert got == [s + " of Spain?" for s in starts]


def test_neighbour_questions_are_sampled_reproducibly_from_the_base_without_touching_the_global_rng(
    model_root,
):
    loaded = _loaded_4bit(model_root)
    for name, p in loaded.model.named_parameters():
        if "lora_B" in name:  # an adapter that changes the model: the neighbours must still be the base's
            p.data.fill_(0.5)
    questions = [f"What colour is thing {i}?" for i in range(3)] + ["Who invented the skyloom?"]
    state = torch.random.get_rng_state()
    first = retention.neighbour_prompts(loaded, questions, 4, seed=3, exclude=set())
    assert torch.equal(torch.random.get_rng_state(), state), "the trainer's seeding is left as it was"
    assert retention.neighbour_prompts(loaded, questions, 4, seed=3, exclude=set()) == first
    for q in first:
        # a start of 2, 3 or 4 words of a question (NEIGHBOUR_PREFIX_WORDS)
        assert q.startswith(("What colour", "Who invented")) and q.endswith("?") and "\n" not in q
    with loaded.model.disable_adapter():
        base_first = retention.neighbour_prompts(loaded, questions, 4, seed=3, exclude=set())
    assert base_first == first


def test_retention_neighbours_needs_kl_and_a_bound():
    sft = dict(method=TrainMethod.SFT)
    assert (
        job_config.with_defaults(
            TrainConfig(**sft, retention=Retention.KL, retention_neighbours=8), session_max_len=64
        ).retention_neighbours
        == 8
    )
    with pytest.raises(InvalidArgument, match=r"retention_neighbours must be in 0\.\.8"):
        job_config.with_defaults(
            TrainConfig(**sft, retention=Retention.KL, retention_neighbours=9), session_max_len=64
        )
    with pytest.raises(InvalidArgument, match="it needs retention KL"):
        job_config.with_defaults(
            TrainConfig(**sft, retention=Retention.REPLAY, retention_neighbours=2), session_max_len=64
        )


def test_a_kl_job_with_neighbours_scores_the_bases_questions_of_its_rows_forms(
    model_root, tmp_path, monkeypatch
):
    asked = {}

    def neighbours(loaded, questions, per_prefix, *, seed, exclude):
        asked.update(questions=questions, per_prefix=per_prefix, seed=seed, exclude=exclude)
        return ["What colour is snow?", "Who wrote Hamlet twice?"]

    monkeypatch.setattr(retention, "neighbour_prompts", neighbours)
    _, (rows, _, _) = _kl_job(
        model_root,
        tmp_path,
        monkeypatch,
        retention=Retention.KL,
        retention_rows=3,
        retention_neighbours=2,
        seed=7,
    )
    assert asked["questions"] == [r["messages"][0]["content"] for r in ROWS[:4]]
    assert (asked["per_prefix"], asked["seed"]) == (2, 7)
    # the training questions, the held-out prompts and the replay prompts are never neighbours
    assert set(asked["questions"]) | set(retention.HELD_OUT_PROMPTS) <= asked["exclude"]
    assert set(retention.REPLAY_PROMPTS[:3]) <= asked["exclude"]
    scored = [r["messages"][0]["content"] for r in rows]
    assert scored == [*retention.REPLAY_PROMPTS[:3], "What colour is snow?", "Who wrote Hamlet twice?"]


def test_a_kl_job_whose_base_writes_no_neighbour_question_trains_on_the_replay_answers_alone(
    model_root, tmp_path, monkeypatch
):
    """A base that ends no continuation with "?" (a small or random model) gives no neighbour questions: the job
    goes on with the replay prompts' answers (it once asked the base to answer an empty batch, and failed)."""
    monkeypatch.setattr(retention, "neighbour_prompts", lambda *a, **kw: [])
    _, (rows, _, _) = _kl_job(
        model_root, tmp_path, monkeypatch, retention=Retention.KL, retention_rows=3, retention_neighbours=4
    )
    assert [r["messages"][0]["content"] for r in rows] == list(retention.REPLAY_PROMPTS[:3])


def test_no_neighbour_questions_where_the_chat_template_rewrites_the_users_text(model_root, monkeypatch):
    loaded = _loaded_4bit(model_root)
    monkeypatch.setattr(loaded.tokenizer, "apply_chat_template", lambda msgs, **kw: "user: (rewritten)\n")

    def generate(**kw):
        raise AssertionError("nothing to continue: nothing generated")

    monkeypatch.setattr(loaded.model, "generate", generate)
    assert (
        retention.neighbour_prompts(loaded, ["What colour is a glimmerfox?"], 2, seed=0, exclude=set()) == []
    )


def test_a_chat_sft_job_that_leaves_retention_unset_runs_the_chat_recipe_and_its_config_says_so(
    client, ready_session, sft_dataset
):
    events = list(client.train(ready_session, sft_dataset.dataset_id, sft_config(2, retention_rows=4)))
    kinds = [e.kind for e in events]
    assert kinds.count("retention") == 1, "the recipe's retention runs: the forgetting metric is reported"
    job = client.get_job(events[-1].job_id)
    assert job.state is JobState.SUCCEEDED
    c = job.config  # stored as it ran: the recipe's values, not the request's zeros
    assert (c.retention, c.retention_kl, c.retention_neighbours, c.adapter_scale) == (
        Retention.KL,
        CHAT_RECIPE_KL,
        CHAT_RECIPE_NEIGHBOURS,
        CHAT_RECIPE_ADAPTER_SCALE,
    )


def test_a_job_resumed_from_a_config_stored_before_retention_was_resolved_still_runs_none(
    trainer, client, ready_session, sft_dataset
):
    """A job stored with retention unset ran without retention (the default then): resumed, it goes on the same way,
    not with the chat recipe that an unset retention now resolves to."""
    _, core, _ = trainer
    cfg = sft_config(2, retention=Retention.NONE, checkpoint_every_steps=1)
    first = list(client.train(ready_session, sft_dataset.dataset_id, cfg))
    job_id = first[-1].job_id
    stored = core.store.get_job(job_id).config
    core.store.update_job(
        job_id, config=replace(stored, retention=Retention.UNSPECIFIED)
    )  # as stored back then
    resumed = list(client.train(ready_session, resume_from_job_id=job_id))
    assert resumed[-1].state.state is JobState.SUCCEEDED, resumed[-1]
    assert "retention" not in [e.kind for e in resumed], "no forgetting metric: no retention ran"
    c = client.get_job(resumed[-1].job_id).config
    assert (c.retention, c.adapter_scale) == (Retention.NONE, 0.0)
