"""``kernels/trainers/sft.py``'s ``GraphedSFTSteps``: SFT micro-steps through a step graph where the job's memory mode
sets ``step_graphs``.

CPU tier: the graphed step's function (TRL's plain branch with the fused head over every position, HF's step around
it) trains as the eager path does — losses, token accuracy, entropy, token counts and the adapter, with gradient
accumulation and padded rows whose prompts are not scored — run eagerly by its step graph off CUDA; and where the
step cannot go through a graph (here: off CUDA) HF's step runs, bit for bit, the reason logged once. GPU tier: on
CUDA the steps replay after the graph's warm-up and train as the eager trainer does.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.deps import locked
from tests.kernels._tolerances import assert_close_fp32, cpu_tier, needs_cuda
from tests.kernels.ops.test_fused_linear_logprobs import _sft_rows, _tiny_sft_trainer

trl = locked("trl")

# TRL checkpoints the layers by default; nothing in these models is random, so no RNG state to save (a capture
# cannot read it)
NO_RNG = {"use_reentrant": False, "preserve_rng_state": False}


KL_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"what is {i} and {i + 1}?"},
            {"role": "assistant", "content": "it is " + "more " * i + "than that."},
        ]
    }
    for i in range(5)
]


def _train(
    tmp_path, name: str, graphs: bool, *, force: bool = False, monkeypatch=None, kl: float = 0.0, **kw
):
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class
    from strop.kernels.trainers.sft import GraphedSFTSteps

    tok = make_bpe_tokenizer()
    kw.setdefault("gradient_checkpointing_kwargs", NO_RNG)
    trainer = _tiny_sft_trainer(
        strop_sft_trainer_class(),
        tok,
        _sft_rows(len(tok)),
        tmp_path / name,
        batch_size=2,
        targets=["q_proj", "v_proj", "down_proj"],
        max_steps=3,
        logging_steps=1,
        **kw,
    )
    trainer._strop_step_graphs = graphs
    if kl:  # the chat recipe's retention KL term (the base: the model with its adapter disabled)
        from strop.trainer_svc.core import retention

        retention.add_replay_kl(trainer, retention.ReplayKL(KL_ROWS, tok, kl, 2, "cpu"))
    if force:  # past the CUDA check: the step graph's own eager steps (off CUDA) run the graphed function
        real = GraphedSFTSteps._strop_graph_reason

        def reason(self, model, inputs, num):
            why = real(self, model, inputs, num)
            return None if why == "the model is not on CUDA" else why

        monkeypatch.setattr(GraphedSFTSteps, "_strop_graph_reason", reason)
    model = trainer.model
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, logs, adapter


@cpu_tier
@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-micro-step", "two-accumulated"])
def test_the_graphed_step_trains_as_the_eager_step(tmp_path, monkeypatch, accumulate):
    kw = {"gradient_accumulation_steps": accumulate}
    _, ref_logs, ref_adapter = _train(tmp_path, "eager", False, **kw)
    trainer, logs, adapter = _train(tmp_path, "graphed", True, force=True, monkeypatch=monkeypatch, **kw)
    graph = trainer._strop_graph
    # 3 batches an epoch: with 2 accumulated, steps of 2, then 1 (the epoch's last, a partial accumulation), then 2
    micro_steps = {1: 3, 2: 5}[accumulate]
    assert graph is not None and graph.stats.eager == micro_steps, "every micro-step through the step graph"
    assert set(graph.reasons.values()) == {"not one CUDA device (cpu)"}, "one reason, each batch width"
    assert len(logs) == len(ref_logs) == 3
    for key in ("loss", "entropy"):
        assert_close_fp32(torch.tensor([h[key] for h in logs]), torch.tensor([h[key] for h in ref_logs]), key)
    for key in ("mean_token_accuracy", "num_tokens"):
        assert [h[key] for h in logs] == [h[key] for h in ref_logs], key
    for n, w in ref_adapter.items():
        assert_close_fp32(adapter[n], w, f"final {n}")


@cpu_tier
@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-micro-step", "two-accumulated"])
def test_the_graphed_step_with_the_retention_kl_term_trains_as_hfs_step_with_it(
    tmp_path, monkeypatch, accumulate
):
    """The KL term the chat recipe adds runs after the graph, its backward on its own: the gradients add up to the
    backward of the sum that HF's step takes (fp32, summation order apart), and the reported loss is the rows' own in
    both. Its weight is large enough that the adapter differs measurably from a run without it."""
    kw = {"gradient_accumulation_steps": accumulate}
    _, plain_logs, plain_adapter = _train(tmp_path, "plain", False, **kw)
    _, ref_logs, ref_adapter = _train(tmp_path, "eager", False, kl=5.0, **kw)
    trainer, logs, adapter = _train(
        tmp_path, "graphed", True, force=True, monkeypatch=monkeypatch, kl=5.0, **kw
    )
    graph = trainer._strop_graph
    assert graph is not None and graph.stats.eager == {1: 3, 2: 5}[accumulate], (
        "every micro-step through the graph"
    )
    assert_close_fp32(
        torch.tensor([h["loss"] for h in logs]), torch.tensor([h["loss"] for h in ref_logs]), "loss"
    )
    for n, w in ref_adapter.items():
        assert_close_fp32(adapter[n], w, f"final {n}")
    moved = max(float((ref_adapter[n] - plain_adapter[n]).abs().max()) for n in ref_adapter)
    assert moved > 1e-3, "the term trains"
    first = torch.tensor([logs[0]["loss"], plain_logs[0]["loss"]])
    assert_close_fp32(first[0], first[1], "the first step reports the rows' loss alone, on the same weights")


@cpu_tier
def test_only_the_term_its_compute_loss_adds_runs_after_the_graph(tmp_path):
    """The graphed step runs an added term only where the class whose ``compute_loss`` adds it defines it: a
    subclass that swaps the term alone, or a term beside the plain ``compute_loss``, keeps HF's step."""
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class
    from strop.trainer_svc.core import retention

    tok = make_bpe_tokenizer()
    inputs = {"input_ids": None, "attention_mask": None, "labels": None}

    def reason(trainer):
        return trainer._strop_graph_reason(trainer.model, inputs, 1)

    def trainer(name):
        return _tiny_sft_trainer(
            strop_sft_trainer_class(), tok, _sft_rows(len(tok)), tmp_path / name, batch_size=2,
            gradient_checkpointing_kwargs=NO_RNG,
        )  # fmt: skip

    t = trainer("kl")
    retention.add_replay_kl(t, retention.ReplayKL(KL_ROWS, tok, 1.0, 2, "cpu"))
    assert reason(t) == "the model is not on CUDA", "the KL term: past the loss check"
    t.__class__ = type("SwappedTerm", (type(t),), {"_strop_added_loss": lambda self, model: 0})
    assert "a term added to the loss" in reason(t)
    t = trainer("beside")
    t.__class__ = type("TermBeside", (type(t),), {"_strop_added_loss": lambda self, model: 0})
    assert "a term added to the loss" in reason(t)


@cpu_tier
@pytest.mark.parametrize(
    ("checkpointing", "why"),
    [
        (NO_RNG, "the model is not on CUDA"),
        ({"use_reentrant": False}, "checkpointed layers save the RNG state, which a capture cannot read"),
    ],
    ids=["off-cuda", "rng-state-saved"],
)
def test_where_no_graph_can_run_hfs_step_runs_bit_for_bit_and_says_why(tmp_path, caplog, checkpointing, why):
    kw = {"gradient_checkpointing_kwargs": checkpointing}
    _, ref_logs, ref_adapter = _train(tmp_path, "eager", False, **kw)
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        trainer, logs, adapter = _train(tmp_path, "graphs-on", True, **kw)
    assert trainer._strop_graph is None
    said = [r.getMessage() for r in caplog.records if "step graphs" in r.getMessage()]
    assert said == [f"step graphs: HF's training step runs ({why})"], said
    assert logs == ref_logs or [h["loss"] for h in logs] == [h["loss"] for h in ref_logs]
    assert all(torch.equal(adapter[n], w) for n, w in ref_adapter.items())


@pytest.mark.gpu
@needs_cuda
def test_gpu_sft_steps_replay_and_train_as_the_eager_trainer(tmp_path):
    """On CUDA (fp32, the tiny model): after the step graph's two eager warm-up steps, every micro-step replays; the
    losses and the adapter are the eager trainer's within fp32 rounding of reordered sums."""
    from strop.kernels.models import patch_model

    runs = []
    for graphs in (False, True):
        from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
        from strop.kernels.trainers import strop_sft_trainer_class

        tok = make_bpe_tokenizer()
        trainer = _tiny_sft_trainer(
            strop_sft_trainer_class(),
            tok,
            _sft_rows(len(tok), n=16),
            tmp_path / str(graphs),
            batch_size=2,
            targets=["q_proj", "v_proj", "down_proj"],
            max_steps=8,
            logging_steps=1,
            use_cpu=False,
            gradient_checkpointing_kwargs=NO_RNG,
        )
        patch_model(trainer.model, device="cuda")
        trainer._strop_step_graphs = graphs
        trainer.train()
        logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        runs.append((trainer, logs, adapter))
    (_, ref_logs, ref_adapter), (trainer, logs, adapter) = runs
    graph = trainer._strop_graph
    assert graph.reasons == {} and graph.stats.replayed >= 1, (graph.reasons, graph.stats)
    assert_close_fp32(torch.tensor(logs), torch.tensor(ref_logs), "per-step losses")
    for n, w in ref_adapter.items():
        assert_close_fp32(adapter[n], w, f"final {n}")


@cpu_tier
def test_checkpointing_without_the_rng_state_is_set_where_hfs_train_reads_it(tmp_path):
    """The trainer's switch for step graphs sets ``preserve_rng_state`` False in the kwargs HF's ``train()`` passes to
    ``gradient_checkpointing_enable`` (named ``activation_…`` from transformers 5.24), keeping the others; the
    graphed step's own check then finds nothing to refuse."""
    from strop.kernels.trainers.sft import _checkpointing, checkpoint_without_rng_state

    trainer, _, _ = _train(tmp_path, "args", False, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _checkpointing(trainer.args) == (True, {"use_reentrant": False})
    checkpoint_without_rng_state(trainer.args)
    assert _checkpointing(trainer.args) == (True, {"use_reentrant": False, "preserve_rng_state": False})
