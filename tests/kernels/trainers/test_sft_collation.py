"""StropSFTTrainer's collation: TRL's language-modeling collator handed each row's tokens as arrays collates the
batches TRL's own collator does, tensor for tensor and dtype for dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strop.kernels.trainers.sft import _token_arrays
from tests.deps import locked
from tests.kernels._tolerances import cpu_tier
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
