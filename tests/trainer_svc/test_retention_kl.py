"""retention_kl: a KL(base ‖ model) term on the replayed answers, checked against plain torch on full logits.

The chunked KL (``kernels/losses/kl.py``) against torch's ``kl_div`` on the full [M, V] logits; the replay term
(``retention.ReplayKL``) against two plain forwards of the PEFT model (adapter on, adapter disabled) row by row,
unpadded; its place in a job (added to every training step's loss, refused where nothing is replayed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    DatasetFormat,
    LoadModelRequest,
    LoraConfig,
    Retention,
    TrainConfig,
    TrainMethod,
)
from strop.kernels.losses.kl import token_kl, token_kl_reference
from strop.trainer_svc.core import job_config, model_loading, retention, training


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


def test_replay_kl_is_the_adapted_models_kl_to_the_base_on_the_answer_tokens(model_root):
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
                base = peft(input_ids=ids).logits[0, :-1][scored].float().log_softmax(-1)
            mine = peft(input_ids=ids).logits[0, :-1][scored].float().log_softmax(-1)
            terms.append(F.kl_div(mine, base, log_target=True, reduction="sum"))
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


def test_a_job_with_retention_kl_adds_the_term_to_its_training_loss(model_root, tmp_path, monkeypatch):
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
    with pytest.raises(InvalidArgument, match="needs retention REPLAY, not NONE"):
        job_config.with_defaults(
            TrainConfig(**sft, retention=Retention.NONE, retention_kl=1.0), session_max_len=64
        )

    with pytest.raises(InvalidArgument, match="this job does not replay"):
        job_config.retention_of(TrainConfig(**sft, retention_kl=1.0), DatasetFormat.MESSAGES, object())
