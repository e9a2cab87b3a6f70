"""StropSFTTrainer's collation: TRL's language-modeling collator handed each row's tokens as arrays collates the
batches TRL's own collator does, tensor for tensor and dtype for dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strop.kernels.trainers._glue import width_buckets
from strop.kernels.trainers.sft import _token_arrays
from tests.deps import locked
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier
from tests.kernels.ops.test_fused_linear_logprobs import _sft_rows, _tiny_sft_trainer


def _same_batch(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@cpu_tier
def test_strop_sft_trainer_collates_the_batches_trls_collator_does(tmp_path):
    locked("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class

    tok = make_bpe_tokenizer()
    trainer = _tiny_sft_trainer(strop_sft_trainer_class(), tok, _sft_rows(len(tok)), tmp_path, batch_size=3)
    ours = trainer.data_collator
    assert (
        isinstance(ours, DataCollatorForLanguageModeling)
        and type(ours) is not DataCollatorForLanguageModeling
    ), "the SFT trainer's collator is strop's subclass of TRL's (TRL's isinstance checks still hold)"
    ref = DataCollatorForLanguageModeling(pad_token_id=ours.pad_token_id)
    # rows as the trainer's dataloader reads them: the prepared dataset's (labels from the completion mask), of
    # three lengths (padding), one row with no scored token
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert isinstance(rows[0]["input_ids"], list), "the dataset hands the collator Python lists"
    handed = _token_arrays(rows[0])
    assert all(isinstance(handed[k], np.ndarray) for k in ("input_ids", "labels")), (
        "TRL's collator gets arrays"
    )
    for start in (0, 3):
        _same_batch(ours(rows[start : start + 3]), ref(rows[start : start + 3]))
    # rows without labels (labels are the ids) and values numpy would read as another dtype, left to TRL as they are
    plain = [{"input_ids": r["input_ids"]} for r in rows[:3]]
    _same_batch(ours(plain), ref(plain))
    odd = [{"input_ids": [True, False, True]}, {"input_ids": [1, 2.5]}]
    for row in odd:
        _same_batch(ours([row]), ref([row]))
    assert (
        ref([odd[0]])["input_ids"].dtype == torch.bool and ref([odd[1]])["input_ids"].dtype == torch.float32
    )
    for collate in (ref, ours):  # ids past int64 fail in TRL's collator either way
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            collate([{"input_ids": [2**63, 1]}])


@cpu_tier
def test_a_users_own_collator_is_kept(tmp_path):
    locked("trl")
    from datasets import Dataset
    from trl import SFTConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class
    from tests.kernels.ops.test_fused_linear_logprobs import _tiny_lora_llama

    class Mine(DataCollatorForLanguageModeling):
        pass

    tok = make_bpe_tokenizer()
    mine = Mine(pad_token_id=0)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_steps=1)
    trainer = strop_sft_trainer_class()(
        model=_tiny_lora_llama(len(tok), ("q_proj",)),
        args=args,
        train_dataset=Dataset.from_list(_sft_rows(len(tok))),
        processing_class=tok,
        data_collator=mine,
    )
    assert trainer.data_collator is mine


# ---------------------------------------------------------------------------------- batch widths in buckets


def _rows_of(lengths: list[int], prompt: int = 5) -> list[dict]:
    """SFT rows of these lengths (random ids; the first ``prompt`` tokens unscored: completion-only loss)."""
    gen = torch.Generator().manual_seed(5)
    return [
        {
            "input_ids": torch.randint(0, 300, (n,), generator=gen).tolist(),
            "completion_mask": [0] * prompt + [1] * (n - prompt),
        }
        for n in lengths
    ]


def _sft_trainer(tmp_path, rows, *, cuda: bool = False, **config):
    """strop's SFT trainer (seeded) on a 2-layer Llama with LoRA on every projection, HF's ``sdpa`` attention."""
    from datasets import Dataset
    from trl import SFTConfig

    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.kernels.trainers import strop_sft_trainer_class
    from tests.kernels.ops.test_fused_linear_logprobs import _tiny_lora_llama

    tok = make_bpe_tokenizer()
    model = _tiny_lora_llama(
        len(tok), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert model.config._attn_implementation == "sdpa", "the attention whose shapes the buckets are for"
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(rows),
        report_to=[],
        save_strategy="no",
        use_cpu=not cuda,
        bf16=cuda,
        seed=0,
        completion_only_loss=True,
        disable_tqdm=True,
        **config,
    )
    return strop_sft_trainer_class()(
        model=model.cuda() if cuda else model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )


def _prepared(trainer) -> list[dict]:
    """The trainer's rows as its dataloader hands them to the collator."""
    return [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]


@cpu_tier
def test_bucketed_collator_pads_the_batch_to_its_bucket_with_columns_nothing_reads(tmp_path, monkeypatch):
    """With the switch on, each batch's width is ``shared_prompt.bucket(width)`` (at most max_length): TRL's batch
    in the first columns, then pad ids, attention mask 0 and labels -100, which no attention, loss or token count
    reads. Off (and by default off CUDA), and for a collator with ``pad_to_multiple_of``, the batch is TRL's as it is."""
    locked("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.kernels.trainers import shared_prompt
    from strop.kernels.trainers.shared_prompt import bucket

    assert shared_prompt.WIDTH_BUCKETS is None, (
        "auto: where cuDNN's SDPA may run (shared_prompt.WIDTH_BUCKETS)"
    )
    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", True)
    rows_in = _rows_of([20, 17, 9])  # width 20: its bucket 32 (below 128 buckets are multiples of 16)
    for max_length, width in ((1024, bucket(20)), (28, 28)):  # the cap: never past max_length
        trainer = _sft_trainer(tmp_path, rows_in, max_length=max_length)
        rows = _prepared(trainer)
        ref = DataCollatorForLanguageModeling(pad_token_id=trainer.data_collator.pad_token_id)(rows)
        ours = trainer.data_collator(rows)
        assert width == (32 if max_length == 1024 else 28) and ref["input_ids"].shape == (3, 20)
        assert ours.keys() == ref.keys() and ours["input_ids"].shape == (3, width)
        for key, value in ref.items():
            assert torch.equal(ours[key][:, :20], value), f"{key}: TRL's batch in the first 20 columns"
        pads = {"input_ids": trainer.data_collator.pad_token_id, "labels": -100, "attention_mask": 0}
        for key, value in pads.items():
            assert (ours[key][:, 20:] == value).all(), f"{key}: {value} past the real width"
    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", False)
    trainer = _sft_trainer(tmp_path, rows_in)
    rows = _prepared(trainer)
    _same_batch(trainer.data_collator(rows), DataCollatorForLanguageModeling(pad_token_id=0)(rows))
    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", True)
    trainer = _sft_trainer(tmp_path, rows_in, pad_to_multiple_of=8)
    assert trainer.data_collator(_prepared(trainer))["input_ids"].shape[1] == 24, (
        "the user's multiple of 8, kept"
    )
    # past BUCKET_MAX a batch keeps its width, and a batch with keys the bucketing does not know is left as it is
    long = {"input_ids": torch.zeros(1, shared_prompt.BUCKET_MAX + 1, dtype=torch.long)}
    assert shared_prompt.bucketed_width(long, 0)["input_ids"].shape[1] == shared_prompt.BUCKET_MAX + 1
    odd = {"input_ids": torch.zeros(1, 20, dtype=torch.long), "token_type_ids": torch.zeros(1, 20)}
    assert shared_prompt.bucketed_width(odd, 0) is odd


@cpu_tier
def test_bucketed_batch_trains_as_the_unpadded_batch(tmp_path, monkeypatch):
    """SFT with completion-only loss, packing off: the padded batch's loss, LoRA gradients and token count are the
    unpadded batch's. The added columns are keys no real query attends to (masked: an exact zero weight), queries
    whose outputs no label reads (zero gradient, so no contribution to any weight's gradient) and positions no
    label or count includes; what may differ is only the order fp32 sums run in (GEMMs over more rows), hence
    DESIGN's fp32 tolerance."""
    locked("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.kernels.models import patch_model
    from strop.kernels.trainers import shared_prompt

    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", True)
    trainer = _sft_trainer(tmp_path, _rows_of([20, 17, 9]))
    rows = _prepared(trainer)
    batches = {
        "bucketed": trainer.data_collator(rows),
        "TRL's": DataCollatorForLanguageModeling(pad_token_id=trainer.data_collator.pad_token_id)(rows),
    }
    assert batches["bucketed"]["input_ids"].shape[1] == 32 > batches["TRL's"]["input_ids"].shape[1] == 20
    model = trainer.model
    patch_model(
        model
    )  # strop's kernels, as its SFT jobs run: token-wise, so the padding leaves real rows alone
    gen = torch.Generator().manual_seed(6)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT starts B at zero, which leaves A's gradient zero: nothing to compare
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    model.train()
    runs = {}
    for name, batch in batches.items():
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        runs[name] = (loss.detach(), grads, trainer._strop_tokens[-1])
    (loss, grads, tokens), (ref_loss, ref_grads, ref_tokens) = runs["bucketed"], runs["TRL's"]
    assert tokens == ref_tokens == 20 + 17 + 9, "the token count is the real tokens'"
    assert_close_fp32(loss, ref_loss, "the loss")
    assert len(grads) == 2 * 7 * 2, "A and B of seven projections in two layers"
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, f"{n} has a gradient to compare"
        assert_close_fp32(grads[n], g, f"{n}'s gradient")


@cpu_tier
def test_packed_and_padding_free_batches_are_left_alone(tmp_path, monkeypatch):
    """Packing (TRL's default bfd strategy: padding-free, one row of the packed width) is not bucketed, switch on:
    the collator's batch is TRL's, tensor for tensor."""
    locked("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.kernels.trainers import shared_prompt

    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", True)
    trainer = _sft_trainer(tmp_path, _rows_of([20, 17, 9, 13]), packing=True, max_length=40)
    ours = trainer.data_collator
    assert ours.padding_free, "TRL packs padding-free"
    rows = _prepared(trainer)
    ref = DataCollatorForLanguageModeling(pad_token_id=ours.pad_token_id, padding_free=True)(rows)
    assert ref["input_ids"].shape[1] not in (16, 32, 48, 64), "a width a bucket would have changed"
    _same_batch(ours(rows), ref)


@cpu_tier
def test_width_buckets_auto_is_off_off_cuda(tmp_path, monkeypatch):
    """``WIDTH_BUCKETS = None`` buckets only where cuDNN's SDPA may run: not on the CPU."""
    locked("trl")
    from strop.kernels.trainers import shared_prompt

    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", None)
    trainer = _sft_trainer(tmp_path, _rows_of([20, 17, 9]))
    assert not width_buckets(trainer)
    assert trainer.data_collator(_prepared(trainer))["input_ids"].shape[1] == 20


@pytest.mark.gpu
def test_width_buckets_auto_on_cuda_and_the_bucketed_batch_trains_within_bf16_rounding(tmp_path, monkeypatch):
    """``WIDTH_BUCKETS = None`` on CUDA in bf16 with cuDNN's SDPA enabled buckets the batch (where cuDNN's graphs are
    built per shape). In bf16 the padded batch's GEMMs run over more rows, which may pick other kernels and round
    otherwise: its loss and LoRA gradients must be within DESIGN's bf16 rule of the fp32 truth (the unpadded batch
    without autocast), against torch's own bf16 run of the unpadded batch."""
    locked("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from strop.kernels.models import patch_model
    from strop.kernels.trainers import shared_prompt

    if not torch.backends.cuda.cudnn_sdp_enabled():
        pytest.skip("cuDNN's SDPA is disabled here")
    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", None)
    trainer = _sft_trainer(tmp_path, _rows_of([100, 83, 41]), cuda=True)
    assert width_buckets(trainer), "CUDA, bf16, cuDNN's SDPA, sdpa attention: on"
    rows = _prepared(trainer)
    bucketed = trainer.data_collator(rows)
    plain = DataCollatorForLanguageModeling(pad_token_id=trainer.data_collator.pad_token_id)(rows)
    assert bucketed["input_ids"].shape[1] == 112 > plain["input_ids"].shape[1] == 100, "100's bucket: 112"
    model = trainer.model
    patch_model(model)
    gen = torch.Generator().manual_seed(6)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT starts B at zero, which leaves A's gradient zero: nothing to compare
            p.data = (torch.randn(p.shape, generator=gen) * 0.1).to(p.device)
    model.train()
    runs = {}
    for name, batch, bf16 in (("truth", plain, False), ("torch", plain, True), ("ours", bucketed, True)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = trainer.compute_loss(model, {k: v.cuda() for k, v in batch.items()})
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        runs[name] = (loss.detach().float(), grads)
    assert_bf16_within_torch_bound(runs["ours"][0], runs["torch"][0], runs["truth"][0], "the loss")
    for n, truth in runs["truth"][1].items():
        assert truth.abs().max() > 0, f"{n} has a gradient to compare"
        assert_bf16_within_torch_bound(runs["ours"][1][n], runs["torch"][1][n], truth, f"{n}'s gradient")
