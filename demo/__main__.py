"""``python -m strop.demo`` (README command one): the whole of strop on localhost, end to end.

1. generate a tiny Llama with a byte-level BPE tokenizer and prequantize it to bnb 4-bit (NF4);
2. start the trainer and export services as local processes;
3. through the SDK: load the 4-bit model, attach LoRA, ask the fixed question (wrong answer),
   run SFT until the model answers it with the fixed sentence, run a short DPO and show the reward
   margin rising, save the adapter;
4. export the adapter to every target (merged safetensors, PEFT, GGUF + K-quants, GGUF LoRA) and verify
   each output in the program that loads it, against the merged model and against the model as trained
   (the 4-bit base as the trainer loaded it + the adapter unmerged); print each GGUF's quantization
   report (the tensor types read back from the file, fallbacks and why);
5. print a summary.

Minutes on a CPU-only machine; uses the GPU when there is one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from strop.client import LoraConfig, Retention, TrainConfig, TrainerClient, TrainMethod
from strop.client.progress import follow
from strop.demo.data import ANSWER, QUESTION, dpo_rows, sft_rows
from strop.demo.services import start_service

SFT = TrainConfig(
    method=TrainMethod.SFT,
    learning_rate=2e-3,
    max_steps=120,
    batch_size=4,
    completion_only_loss=True,
    lr_scheduler="constant",
    checkpoint_every_steps=40,
    seed=0,
    retention=Retention.NONE,  # a random tiny model knows nothing to keep: the rows alone (not the chat recipe)
)
DPO = TrainConfig(
    method=TrainMethod.DPO,
    learning_rate=5e-4,
    max_steps=12,
    batch_size=6,
    dpo_beta=0.1,
    lr_scheduler="constant",
    seed=0,
)
LORA = LoraConfig(r=16, alpha=32, dropout=0.0, seed=0)


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run(workdir: Path, *, keep: bool) -> dict:
    from strop.fixtures import make_tiny_model, quantize_4bit

    t_start = time.time()
    if workdir.exists() and not keep:
        shutil.rmtree(workdir)
    models, artifacts = workdir / "models", workdir / "artifacts"
    banner("1. generate a tiny Llama + tokenizer and a bnb-4bit prequantized copy")
    make_tiny_model(models / "tiny-llama", arch="llama", tokenizer="bpe", seed=0)
    quantize_4bit(models / "tiny-llama", models / "tiny-llama-4bit")
    print(f"models under {models}")

    banner("2. start the trainer service on localhost")
    trainer = start_service(
        "trainer",
        [
            "--model-root",
            str(models),
            "--artifact-root",
            str(artifacts),
            "--state-dir",
            str(workdir / "state" / "trainer"),
        ],
        workdir / "logs",
    )
    print(f"trainer service at {trainer.target} (log {trainer.log_path})")
    summary: dict = {}
    try:
        with TrainerClient(trainer.target) as tc:
            banner("3. load the 4-bit model and attach LoRA")
            s = tc.load_model("tiny-llama-4bit")
            f = s.facts
            print(
                f"session {s.session_id}: {f.architecture}, {f.num_parameters:,} params, {f.quantization}, "
                f"{f.compute_dtype} on {f.device}; kernels: {f.kernels_reason}"
            )
            s = tc.attach_lora(s.session_id, LORA)
            print(
                f"LoRA r={s.lora.r} alpha={s.lora.alpha} on {s.lora.target_modules}: "
                f"{s.facts.num_trainable_parameters:,} trainable params"
            )
            before = tc.generate(s.session_id, QUESTION, max_new_tokens=24, apply_chat_template=True)[0]
            print(f"Q: {QUESTION}\nA (before SFT): {before!r}")
            if before.strip() == ANSWER:
                raise SystemExit("the untrained model already gives the answer: the demo would prove nothing")

            banner("4. SFT until the model answers with the fixed sentence")
            ds = tc.upload_dataset(sft_rows(), name="demo-sft.jsonl")
            print(f"dataset {ds.dataset_id}: {ds.num_rows} {ds.format.value.lower()} rows")
            sft_job = tc.get_job(follow(tc.train(s.session_id, ds.dataset_id, SFT)))
            after = tc.generate(s.session_id, QUESTION, max_new_tokens=24, apply_chat_template=True)[0]
            print(f"A (after SFT):  {after!r}")
            if after.strip() != ANSWER:
                raise SystemExit(f"SFT did not teach the answer (got {after!r})")

            banner("5. DPO: prefer the answer over refusals")
            pref = tc.upload_dataset(dpo_rows(), name="demo-dpo.jsonl")
            margins: list[float] = []
            dpo_job = tc.get_job(
                follow(
                    tc.train(s.session_id, pref.dataset_id, DPO),
                    on_event=lambda e: e.step and margins.append(e.step.dpo.reward_margin),
                )
            )
            print(f"reward margin: first step {margins[0]:+.4f}, last step {margins[-1]:+.4f}")
            final = tc.generate(s.session_id, QUESTION, max_new_tokens=24, apply_chat_template=True)[0]
            adapter = tc.save_adapter(s.session_id, "demo-adapter")
            print(f"adapter {adapter.artifact_id}: {len(adapter.files)} files, sha256 {adapter.sha256[:16]}…")
            summary.update(
                question=QUESTION,
                before=before,
                after_sft=after,
                after_dpo=final,
                sft_job=sft_job.job_id,
                sft_state=sft_job.state.value,
                sft_steps=sft_job.step,
                sft_final_loss=sft_job.last_loss,
                dpo_job=dpo_job.job_id,
                dpo_state=dpo_job.state.value,
                dpo_margin_first=margins[0],
                dpo_margin_last=margins[-1],
                adapter=adapter.artifact_id,
                device=f.device,
                kernels=f.kernels_enabled,
            )
    finally:
        trainer.stop()
    summary.update(export_demo(workdir, models, artifacts, summary))
    summary["seconds"] = round(time.time() - t_start, 1)
    return summary


def export_demo(workdir: Path, models: Path, artifacts: Path, summary: dict) -> dict:
    try:
        from strop.demo.export_step import run_export_demo
    except ImportError:
        return {"export": "export service not available in this build"}
    banner("6. export the adapter to every target and verify each in its consumer")
    exporter = start_service(
        "export",
        [
            "--model-root",
            str(models),
            "--artifact-root",
            str(artifacts),
            "--state-dir",
            str(workdir / "state" / "export"),
        ],
        workdir / "logs",
    )
    try:
        return run_export_demo(exporter.target, summary["adapter"], question=QUESTION, answer=ANSWER)
    finally:
        exporter.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m strop.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workdir", default="demo-out", help="where models, artifacts, state and logs go")
    p.add_argument("--keep", action="store_true", help="do not wipe the workdir first")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is generated here; nothing is downloaded
    summary = run(Path(a.workdir).resolve(), keep=a.keep)
    banner("summary")
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        if isinstance(v, dict) and len(str(v)) > 200:
            continue  # the per-target figures were printed as a table above
        print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
