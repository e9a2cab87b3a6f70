"""Where a Train job's step spends host time outside the model, on the CPU: the trainer service in process, a 4-bit
Llama of tiny widths with ``--layers`` layers (32: the 8B's module count), strop's kernels on with their Triton launches
stubbed (their outputs garbage, so the gradient guard's finiteness checks are switched off here), HF's ``Trainer``
and callback handler timed by wrapping their methods, in the job thread's CPU time.

The window that matters on the GPU is the host time from the gradient guard's read (the end of the callbacks'
``on_optimizer_step``, the step's one drain of the device) to the next step's first forward op (the embedding):
the GPU has nothing queued over it. ``--hf-loop`` puts back HF's per-step walks of the model that
``training.LeanStepLoop`` trims, for the before/after (bench/RESULTS.md: "the service's host work a step").

    python3 bench/experiments/service_step_host.py [--layers 32] [--steps 14] [--hf-loop]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import tempfile
import time
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument(
        "--hf-loop", action="store_true", help="HF's model.train(), zero_grad, FLOP count, clipping"
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer
    from transformers.trainer_callback import CallbackHandler
    from triton.runtime.interpreter import InterpretedFunction

    from strop.client import KernelMode, LoraConfig, Quantization, TrainConfig, TrainerClient, TrainMethod
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
    from strop.trainer_svc.core import guard, training
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    root = tempfile.mkdtemp(prefix="service-step-host-")
    name = f"tiny-{a.layers}"
    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=a.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=640, tie_word_embeddings=True, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(f"{root}/{name}")
    make_bpe_tokenizer().save_pretrained(f"{root}/{name}")

    InterpretedFunction.run = lambda *args, **kwargs: None  # every Triton launch stubbed
    guard.math = types.SimpleNamespace(
        isfinite=lambda x: True, inf=math.inf
    )  # stubbed kernels: garbage values
    guard.GUARD_WINDOW_STEPS = 0
    training.LeanStepLoop.enabled = not a.hf_loop

    ms = collections.defaultdict(list)  # what -> thread CPU ms, one a call
    mark: dict[str, float] = {}

    def timed(cls, method: str, key: str) -> None:
        fn = getattr(cls, method)

        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                ms[key].append((time.thread_time() - t0) * 1e3)

        setattr(cls, method, call)

    for method in ("training_step", "get_batch_samples", "_maybe_log_save_evaluate", "floating_point_ops"):
        timed(Trainer, method, f"Trainer.{method}")
    timed(torch.nn.Module, "zero_grad", "Module.zero_grad (HF's)")
    timed(torch.optim.AdamW, "step", "AdamW.step (CPU: one tensor at a time)")
    on_optimizer_step, on_step_begin = CallbackHandler.on_optimizer_step, CallbackHandler.on_step_begin
    embedding = torch.nn.Embedding.forward

    def after_read(*args, **kwargs):
        out = on_optimizer_step(*args, **kwargs)
        mark["read"] = time.thread_time()
        return out

    def first_op(module, *args, **kwargs):
        if "read" in mark:
            ms["WINDOW: the guard's read to the next embedding"].append(
                (time.thread_time() - mark.pop("read")) * 1e3
            )
        return embedding(module, *args, **kwargs)

    def begin(*args, **kwargs):
        t = time.thread_time()
        if "begin" in mark:
            ms["a step (on_step_begin to on_step_begin)"].append((t - mark["begin"]) * 1e3)
        mark["begin"] = t
        return on_step_begin(*args, **kwargs)

    CallbackHandler.on_optimizer_step, CallbackHandler.on_step_begin = after_read, begin
    torch.nn.Embedding.forward = first_op

    ids = torch.randint(0, 640, (2, 16), generator=torch.Generator().manual_seed(1234))
    rows = [{"input_ids": ids[i].tolist()} for i in range(2)] * a.steps
    service = start(TrainerConfig(model_root=root, artifact_root=f"{root}/a", state_dir=f"{root}/s"))
    with TrainerClient(f"127.0.0.1:{service.port}") as tc:
        s = tc.load_model(name, dtype="bfloat16", quantization=Quantization.NF4, kernels=KernelMode.ON)
        s = tc.attach_lora(s.session_id, LoraConfig(r=16, alpha=16))
        ds = tc.upload_dataset(rows)
        cfg = TrainConfig(
            method=TrainMethod.SFT, learning_rate=1e-4, lr_scheduler="constant", batch_size=2, max_length=16,
            max_steps=a.steps, gradient_checkpointing=True, optimizer="adamw_torch", seed=0,
        )  # fmt: skip
        for _ in tc.train(s.session_id, ds.dataset_id, cfg):
            pass  # the job ends FAILED at publishing (the stubbed kernels' adapter is not finite): timed already
    service.stop(grace=1.0)
    print(
        f"{a.layers} layers, {'HF loop' if a.hf_loop else 'LeanStepLoop'}: median ms of thread CPU time a call"
    )
    for key, values in sorted(ms.items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2]):
        kept = sorted(values[3:] if len(values) > 5 else values)  # the first steps compile and warm caches
        print(f"  {key:55s} {kept[len(kept) // 2]:8.2f}  (n={len(values)})")


if __name__ == "__main__":
    main()
