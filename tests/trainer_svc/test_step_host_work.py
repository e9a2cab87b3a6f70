"""A Train job's trainer trims HF's per-step walks of the model (``training.LeanStepLoop``) with the same effects:
the same step events, adapters and ``total_flos`` to the bit, every module in training mode at every forward
(also after a callback put some in eval mode), and no gradient left on any parameter after a step (also a frozen
one's). Reference: the same job with HF's ``model.train()``, ``model.zero_grad()``, ``floating_point_ops`` and clipping.

The work removed is counted too (submodules' ``train`` calls, ``num_parameters`` calls, ``.grad`` reads through
bitsandbytes' ``__torch_function__`` in the steps), so the test fails if the trimmed paths stop being taken.
"""

from __future__ import annotations

import pytest
import torch

from strop.common.trainer_types import DatasetFormat
from strop.trainer_svc.core import training
from tests.trainer_svc.test_step_reads import ROWS, sft_job


def _train(model_root, tmp_path, label: str):
    """A 4-bit SFT job's trainer as ``run_training`` builds it (kernels on, interpreted: a CUDA session's trainer),
    three steps of two micro-batches with a checkpoint; a callback puts the attention modules in eval mode after
    step 1 and gives a frozen weight a stale gradient before each ``zero_grad``. Returns the step events, the final
    adapter, ``total_flos``, each forward's "every module training" flag, the gradients left after each step, and
    the counts of the work HF's walks do."""
    from bitsandbytes.nn import Params4bit
    from transformers import PreTrainedModel, TrainerCallback

    loaded, config = sft_job(model_root, max_steps=3, gradient_accumulation_steps=2, checkpoint_every_steps=2)
    model = loaded.model
    norm = model.get_base_model().model.norm.weight  # frozen
    steps, all_training, grads_left = [], [], []
    counts = dict(submodule_train=0, num_parameters=0, params4bit_reads=0)
    counts["submodules"] = sum(1 for _ in model.modules()) - 1

    stepping = [False]

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            stepping[0] = True

        def on_optimizer_step(self, args, state, control, **kw):
            norm.grad = torch.ones_like(norm)  # a stale gradient on a frozen weight: zero_grad clears it

        def on_step_end(self, args, state, control, **kw):
            stepping[0] = False
            grads_left.append([n for n, p in model.named_parameters() if p.grad is not None])
            if state.global_step == 1:
                for layer in model.get_base_model().model.layers:
                    layer.self_attn.eval()

    model.register_forward_pre_hook(lambda m, a: all_training.append(all(x.training for x in m.modules())))
    sinks = training.Sinks(on_step=steps.append, on_checkpoint=lambda s, p: None, on_start=lambda total: None)
    trainer = training.build_trainer(
        loaded, ROWS, DatasetFormat.TEXT, config, tmp_path / label, training.JobControl(), sinks, [Probe()]
    )
    module_train, num_parameters = torch.nn.Module.train, PreTrainedModel.num_parameters
    torch_function = Params4bit.__torch_function__.__func__

    def counting_train(self, mode=True):
        counts["submodule_train"] += self is not model
        return module_train(self, mode)

    def counting_num_parameters(self, *a, **k):
        counts["num_parameters"] += 1
        return num_parameters(self, *a, **k)

    def counting_torch_function(cls, func, types, args=(), kwargs=None):
        # in the steps (the model's move to its device reads each .grad once a train()); a property read arrives
        # as its descriptor's __get__
        grad = getattr(getattr(func, "__self__", None), "__name__", "") == "grad"
        counts["params4bit_reads"] += stepping[0] and grad
        return torch_function(cls, func, types, args, kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.nn.Module, "train", counting_train)
    mp.setattr(PreTrainedModel, "num_parameters", counting_num_parameters)
    mp.setattr(Params4bit, "__torch_function__", classmethod(counting_torch_function))
    try:
        trainer.train()
    finally:
        mp.undo()
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert "train" not in model.__dict__ and "zero_grad" not in model.__dict__, "removed after train()"
    return steps, adapter, trainer.state.total_flos, all_training, grads_left, counts


def test_the_trimmed_step_loop_trains_as_hfs_with_less_host_work(model_root, tmp_path, monkeypatch):
    steps, adapter, flos, all_training, grads_left, counts = _train(model_root, tmp_path, "ours")
    monkeypatch.setattr(training.LeanStepLoop, "enabled", False)
    ref_steps, ref_adapter, ref_flos, ref_all_training, ref_grads_left, ref_counts = _train(
        model_root, tmp_path, "hf"
    )

    def content(m):  # everything but the wall-clock fields (step_seconds, tokens/s) and the peak memory
        return (m.step, m.total_steps, m.epoch, m.loss, m.learning_rate, m.grad_norm, m.tokens_seen)

    assert [s.step for s in steps] == [1, 2, 3]
    assert [content(s) for s in steps] == [content(s) for s in ref_steps], "the same step events, to the bit"
    assert adapter.keys() == ref_adapter.keys()
    assert all(torch.equal(adapter[n], ref_adapter[n]) for n in adapter), "the same adapter, to the bit"
    assert flos == ref_flos > 0, "HF's FLOP count: 6 x input ids x parameters, summed over the micro-batches"
    # HF puts every module in training mode at each micro-batch's forward, the attention modules set to eval
    # after step 1 included
    assert all_training == ref_all_training == [True] * 6
    assert grads_left == ref_grads_left == [[]] * 3, "zero_grad leaves no gradient, the frozen norm's too"

    # the work removed: HF walks the model each micro-batch; the trimmed loop once a train() (and once after the
    # callback's eval), reads no .grad through the 4-bit bases' override, counts the parameters once
    assert ref_counts["num_parameters"] == 6 and counts["num_parameters"] == 1, (counts, ref_counts)
    # HF's six model.train() calls each set every submodule; the trimmed loop's at most two (the first, if the
    # model was not yet training, and the one after the callback's eval)
    assert counts["submodule_train"] <= ref_counts["submodule_train"] - 4 * counts["submodules"], (
        counts,
        ref_counts,
    )
    assert ref_counts["params4bit_reads"] > 0 and counts["params4bit_reads"] == 0, (counts, ref_counts)
