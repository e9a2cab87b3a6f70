"""Fused linear per-token log-probs: the reference against autograd and TRL's definitions, the derived gradient,
then the Triton op (gradient made in the forward, scaled per row in backward) against the reference; and TRL's
SFTTrainer head served by it (``kernels/trainers/sft.py``) against TRL's own head.

CPU tier: Triton interpreter (TRITON_INTERPRET=1), small odd shapes. GPU tier: 8,192 tokens × hidden 2,048 ×
vocab 65,536 in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import strop.kernels.ops.fused_linear_logprobs as flp
from strop.kernels.ops.fused_linear_logprobs import fused_linear_logprobs, fused_linear_logprobs_reference
from tests.deps import locked
from tests.kernels._loop_reads import LoopBoolReads
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier, needs_cuda

N, H, V = 37, 67, 300  # odd token count, hidden and vocab


def _inputs(n=N, h=H, v=V, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(v, generator=gen)).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    targets[::5] = -100
    grad = torch.randn(n, generator=gen).to(device)  # a different upstream gradient on every row
    return hidden, weight, bias, targets, grad


def _run(fn, hidden, weight, targets, bias, grad, **kw):
    h = hidden.clone().requires_grad_()
    logp, entropy, top1 = fn(h, weight, targets, bias, **kw)
    (dh,) = torch.autograd.grad((logp * grad).sum(), (h,))
    return logp.detach(), entropy.detach(), top1, dh


@cpu_tier
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_reference_log_probs_and_entropy_follow_their_definitions(softcap):
    hidden, weight, bias, targets, _ = _inputs()
    logp, entropy, top1 = fused_linear_logprobs_reference(hidden, weight, targets, bias, softcap=softcap)
    z = F.linear(hidden, weight, bias).double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    p = torch.softmax(z, -1)
    valid = targets != -100
    want_logp = torch.log(p.gather(1, targets.clamp(min=0)[:, None])).squeeze(1) * valid
    want_entropy = -(p * torch.log(p)).sum(-1) * valid  # H = −Σ p log p
    assert_close_fp32(logp, want_logp.float(), "log p(target)")
    assert_close_fp32(entropy, want_entropy.float(), "entropy −Σ p log p")
    want_top1 = (z.argmax(-1) == targets) & valid  # argmax returns the first maximum: TRL's tie rule
    assert torch.equal(top1, want_top1)


@cpu_tier
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_derived_gradient_matches_autograd_of_reference(softcap):
    hidden, weight, bias, targets, grad = _inputs()
    hidden = 3 * hidden  # logits of several units: the cap binds
    _, _, _, dh = _run(fused_linear_logprobs_reference, hidden, weight, targets, bias, grad, softcap=softcap)
    z = F.linear(hidden, weight, bias).float()
    factor = torch.ones_like(z)
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z, factor = softcap * t, 1 - t * t
    onehot = F.one_hot(targets.clamp(min=0), V).float()
    e = (torch.softmax(z, -1) - onehot) * factor * (targets != -100)[:, None]  # the kernel's e
    assert_close_fp32(dh, -grad[:, None] * (e @ weight), "dx = −g · e W")


@cpu_tier
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("bias_on", [False, True])
def test_op_matches_reference_in_fp32_over_chunks_and_vocab_blocks(monkeypatch, softcap, bias_on):
    monkeypatch.setattr(flp, "MAX_BLOCK_V", 128)  # three vocab blocks: the online pass is exercised
    hidden, weight, bias, targets, grad = _inputs()
    bias = bias if bias_on else None
    want = _run(fused_linear_logprobs_reference, hidden, weight, targets, bias, grad, softcap=softcap)
    got = _run(fused_linear_logprobs, hidden, weight, targets, bias, grad, softcap=softcap, chunk_size=8)
    for name, g, w in zip(("log_probs", "entropy"), got[:2], want[:2], strict=True):
        assert_close_fp32(g, w, name)
    assert torch.equal(got[2], want[2]), "is_top1"
    assert_close_fp32(got[3], want[3], "d_hidden")


@cpu_tier
def test_top1_tie_goes_to_the_first_maximum():
    hidden, weight, _, _, _ = _inputs(n=3, v=40)
    weight[7] = weight[3]  # columns 3 and 7 tie on every row
    targets = torch.tensor([3, 7, -100])
    hidden[:2] = 10 * weight[3]  # both rows' maximum is the tie
    _, _, top1 = fused_linear_logprobs(hidden, weight, targets)
    assert top1.tolist() == [True, False, False], "the first of tied maxima is top-1 (torch.argmax, TRL)"


@cpu_tier
def test_bf16_error_is_within_twice_torch_bf16_error():
    hidden, weight, bias, targets, grad = _inputs(dtype=torch.bfloat16)
    truth = _run(fused_linear_logprobs_reference, hidden.float(), weight.float(), targets, bias.float(), grad)
    torch_bf16 = _run(fused_linear_logprobs_reference, hidden, weight, targets, bias, grad)
    ours = _run(fused_linear_logprobs, hidden, weight, targets, bias, grad, chunk_size=8)
    assert ours[0].dtype == torch.float32 and ours[3].dtype == torch.bfloat16
    for i, name in ((0, "log_probs"), (1, "entropy"), (3, "d_hidden")):
        assert_bf16_within_torch_bound(ours[i], torch_bf16[i], truth[i], name)


@cpu_tier
def test_entropy_gradient_and_trainable_head_are_refused_not_dropped():
    hidden, weight, _, targets, _ = _inputs()
    h = hidden.clone().requires_grad_()
    _, entropy, _ = fused_linear_logprobs(h, weight, targets)
    with pytest.raises(RuntimeError, match="entropy as a metric without a gradient"):
        entropy.sum().backward()
    with pytest.raises(ValueError, match="frozen head"):
        fused_linear_logprobs(h, weight.clone().requires_grad_(), targets)


def _tiny_lora_llama(vocab: int, targets):
    """A 2-layer Llama (seed 0) under PEFT with rank-4 LoRA on ``targets``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_cache=False,
    )
    return get_peft_model(
        AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules=list(targets))
    )


@cpu_tier
def test_sft_trainer_head_matches_trls_head_and_gradients(monkeypatch):
    trl_utils = locked("trl.trainer.utils")

    import strop.kernels.trainers.sft as sft

    calls = []
    monkeypatch.setattr(
        sft, "fused_linear_logprobs", lambda *a, **k: calls.append(1) or fused_linear_logprobs(*a, **k)
    )

    def model():
        m = _tiny_lora_llama(320, ["q_proj", "v_proj"])
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)  # a non-zero adapter: its gradient path is live
        trl_utils.add_fused_lm_head(m.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
        return m

    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt: positions scored only where the next label is kept
    runs = []
    for strop_head in (False, True):
        m = model()
        if strop_head:
            sft.add_fused_logprob_head(m.get_base_model())
        out = m(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=torch.tensor(30))
        (0.7 * out.loss).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        runs.append((out, grads, m))
    (ref, ref_grads, _), (out, grads, m) = runs
    assert len(calls) == 1, "the strop head served the fused call (and TRL's head the reference's)"
    assert_close_fp32(out.loss.detach(), ref.loss.detach(), "loss over num_items_in_batch")
    for name in ("log_probs", "entropy"):
        assert_close_fp32(getattr(out, name).detach(), getattr(ref, name).detach(), name)
    assert torch.equal(out.is_top1, ref.is_top1) and torch.equal(out.label_mask, ref.label_mask)
    assert out.log_sum_sq_probs is None and out.mean_logits is None, "fields SFT does not ask for stay None"
    for n, g in ref_grads.items():
        assert_close_fp32(grads[n], g, f"gradient of {n}")
    sft.remove_fused_logprob_head(m.get_base_model())
    again = m(input_ids=ids, labels=labels, fused_lm_head=True)  # TRL's head again
    assert_close_fp32(again.log_probs.detach(), ref.log_probs.detach(), "TRL's head after removal")
    assert len(calls) == 1, "removed: TRL's head serves the call"


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_large_vocab_within_twice_torch_error():
    hidden, weight, _, targets, grad = _inputs(n=8192, h=2048, v=65536, dtype=torch.bfloat16, device="cuda")
    truth = _run(fused_linear_logprobs_reference, hidden.float(), weight.float(), targets, None, grad)
    torch_bf16 = _run(fused_linear_logprobs_reference, hidden, weight, targets, None, grad)
    ours = _run(fused_linear_logprobs, hidden, weight, targets, None, grad, chunk_size=1000)
    for i, name in ((0, "log_probs"), (1, "entropy"), (3, "d_hidden")):
        assert_bf16_within_torch_bound(ours[i], torch_bf16[i], truth[i], name)
    assert (ours[2] == truth[2]).float().mean() > 0.999, "top-1 flags agree but for bf16 near-ties"


def _tiny_sft_trainer(
    cls,
    tok,
    rows,
    output_dir,
    *,
    batch_size: int,
    targets=("q_proj",),
    max_steps: int = 4,
    logging_steps: int = 2,
    **config,
):
    """A ``cls`` SFT trainer (seeded) on a 2-layer Llama with LoRA on ``targets``: plain SGD at 0.5 on CPU
    (``config``: more or other ``SFTConfig`` fields)."""
    from datasets import Dataset
    from trl import SFTConfig

    model = _tiny_lora_llama(len(tok), targets)
    args = SFTConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=logging_steps,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        data_seed=0,
        completion_only_loss=True,
        disable_tqdm=True,
    )
    args = dataclasses.replace(args, **config) if config else args
    return cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


@cpu_tier
def test_strop_sft_trainer_trains_like_trls_sft_trainer(tmp_path):
    """Three SFT steps with a completion mask: per-step losses and the final adapter as TRL's own head gives (fp32).

    Plain SGD, so the adapters differ by what the gradients differ by (Adam's m/√v turns fp32 summation-order
    differences in near-zero gradients into relative ones)."""
    locked("trl")
    from trl import SFTTrainer

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class

    tok = make_bpe_tokenizer()
    gen = torch.Generator().manual_seed(3)
    rows = [
        {
            "prompt": torch.randint(0, 300, (7,), generator=gen).tolist(),
            "completion": torch.randint(0, 300, (9,), generator=gen).tolist(),
        }
        for _ in range(6)
    ]
    rows = [{"input_ids": r["prompt"] + r["completion"], "completion_mask": [0] * 7 + [1] * 9} for r in rows]
    runs = []
    for cls in (SFTTrainer, strop_sft_trainer_class()):
        trainer = _tiny_sft_trainer(
            cls,
            tok,
            rows,
            tmp_path / cls.__name__,
            batch_size=3,
            targets=["q_proj", "v_proj", "down_proj"],
            max_steps=3,
            logging_steps=1,
        )
        model = trainer.model
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        runs.append(([h["loss"] for h in logs], [h["mean_token_accuracy"] for h in logs], adapter))
    (ref_loss, ref_acc, ref_adapter), (loss, acc, adapter) = runs
    assert len(loss) == 3 and ref_loss[-1] < ref_loss[0], "the reference run learns"
    assert_close_fp32(torch.tensor(loss), torch.tensor(ref_loss), "per-step losses")
    assert acc == ref_acc, "token accuracy from is_top1, as TRL logs it"
    for n, w in ref_adapter.items():
        assert_close_fp32(adapter[n], w, f"final {n}")


def _sft_rows(tok_len: int, n: int = 6):
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        prompt = torch.randint(0, min(tok_len, 300), (7,), generator=gen).tolist()
        completion = torch.randint(
            0, min(tok_len, 300), (9 - (i % 3),), generator=gen
        ).tolist()  # padded batches
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * 7 + [1] * len(completion)})
    rows[1]["completion_mask"] = [0] * len(rows[1]["input_ids"])  # a row without a scored position
    return rows


@cpu_tier
def test_sft_metrics_stay_on_device_and_log_trls_values_to_the_bit(tmp_path, monkeypatch):
    """StropSFTMixin.compute_loss reads nothing back from the device (TRL's reads five scalars a micro-batch), and the
    logs it produces — loss, entropy, token accuracy, token count — equal those of TRL's own compute_loss and log on
    the same head, step for step, bit for bit."""
    locked("trl")
    import sys

    from trl import SFTTrainer

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class

    strop_cls = strop_sft_trainer_class()
    # the same strop head, TRL's compute_loss and log: what the mixin's must reproduce
    trl_metrics_cls = type(
        "TrlMetrics", (strop_cls,), {"compute_loss": SFTTrainer.compute_loss, "log": SFTTrainer.log}
    )
    reads: dict[str, list[str]] = {}
    sources = ("trl/trainer/sft_trainer.py", "kernels/trainers/sft.py")

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith(sources) and caller.co_name == "compute_loss":
                reads.setdefault(current, []).append(name)
            return original(self, *a, **k)

        return read

    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    tok = make_bpe_tokenizer()
    rows = _sft_rows(len(tok))
    logs = {}
    for cls in (trl_metrics_cls, strop_cls):
        current = cls.__name__
        trainer = _tiny_sft_trainer(cls, tok, rows, tmp_path / current, batch_size=3)
        trainer.train()
        logs[current] = [
            {k: h[k] for k in ("loss", "entropy", "mean_token_accuracy", "num_tokens")}
            for h in trainer.state.log_history
            if "loss" in h
        ]
    ref, ours = logs["TrlMetrics"], logs["StropSFTTrainer"]
    assert len(ours) == 2 and ours[0]["num_tokens"] < ours[1]["num_tokens"], (
        "logged every 2 steps, tokens add up"
    )
    assert ours == ref, "the same floats as TRL's .item() reads, averaged the same way"
    assert len(reads.get("TrlMetrics", [])) >= 4 * 4, (
        "TRL's compute_loss reads ≥ 4 scalars a step (the test sees them)"
    )
    assert "StropSFTTrainer" not in reads, (
        f"strop's compute_loss read the device: {reads.get('StropSFTTrainer')}"
    )


@cpu_tier
def test_sft_nan_filter_runs_on_the_device_and_logs_what_hfs_filter_logs(tmp_path, monkeypatch):
    """With logging_nan_inf_filter on, StropSFTTrainer's loop reads no loss back after the backward, and a step whose
    loss is NaN logs what HF's own filter logs (the mean of the losses since the last log in its place), bit for bit;
    the user's setting is back after train()."""
    locked("trl")

    from trl import SFTTrainer

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class

    strop_cls = strop_sft_trainer_class()

    def nan_on_step_3(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = cls.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            # a NaN value with the loss's own (finite) gradient: the adapters stay finite, only the log sees it
            return loss + (float("nan") * loss.detach() if self.state.global_step == 2 else 0.0)

        return compute_loss

    hf_filter_cls = type(
        "HfFilter",
        (strop_cls,),
        {
            "train": SFTTrainer.train,
            "training_step": SFTTrainer.training_step,
            "compute_loss": nan_on_step_3(strop_cls),
        },
    )
    ours_cls = type("Ours", (strop_cls,), {"compute_loss": nan_on_step_3(strop_cls)})
    reads = LoopBoolReads(monkeypatch)
    tok = make_bpe_tokenizer()
    rows = _sft_rows(len(tok))
    logs = {}
    for cls in (hf_filter_cls, ours_cls):
        current = reads.current = cls.__name__
        trainer = _tiny_sft_trainer(cls, tok, rows, tmp_path / current, batch_size=2)
        assert trainer.args.logging_nan_inf_filter, "HF's default: the filter is on"
        trainer.train()
        assert trainer.args.logging_nan_inf_filter, "the user's setting is restored"
        logs[current] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ref, ours = logs["HfFilter"], logs["Ours"]
    assert len(ours) == 2 and all(v == v for v in ours), (
        "the NaN of step 3 was filtered out of the second log"
    )
    assert ours == ref, "the same logged losses as HF's own filter"
    assert reads.counts.get("HfFilter", 0) >= 4, (
        "HF's loop reads the loss after every backward (the test sees it)"
    )
    assert "Ours" not in reads.counts, f"the loop read the loss back {reads.counts.get('Ours')} times"
