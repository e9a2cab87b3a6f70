"""A fine-tuning script written for OpenAI's API (the ``openai`` SDK, as its guide writes one): upload a chat file,
create a supervised job, poll it, print its events and checkpoints and the fine-tuned model's name.

Against strop's gateway (``strop serve openai``) it runs unchanged; only the environment names the server and the key,
and ``--model`` a base model of the trainer's model root::

    OPENAI_BASE_URL=http://127.0.0.1:8001/v1 OPENAI_API_KEY=<a strop token> \\
        python docs/examples/openai_fine_tune.py train.jsonl --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("training_file", help="a JSONL file of {'messages': [...]} rows")
    p.add_argument("--validation-file")
    p.add_argument("--model", default="gpt-4o-mini-2024-07-18")
    p.add_argument("--suffix", default="example")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--poll-seconds", type=float, default=10.0)
    args = p.parse_args()

    client = OpenAI()  # OPENAI_API_KEY and OPENAI_BASE_URL from the environment
    with open(args.training_file, "rb") as f:
        training = client.files.create(file=f, purpose="fine-tune")
    print(f"uploaded {training.filename} as {training.id} ({training.bytes} bytes)")
    validation = None
    if args.validation_file:
        with open(args.validation_file, "rb") as f:
            validation = client.files.create(file=f, purpose="fine-tune").id

    job = client.fine_tuning.jobs.create(
        model=args.model,
        training_file=training.id,
        validation_file=validation,
        suffix=args.suffix,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": args.epochs}}},
    )
    print(f"created {job.id}: {job.status}")
    while job.status not in ("succeeded", "failed", "cancelled"):
        time.sleep(args.poll_seconds)
        job = client.fine_tuning.jobs.retrieve(job.id)
        print(f"  {job.status}")

    for event in reversed(list(client.fine_tuning.jobs.list_events(fine_tuning_job_id=job.id, limit=50))):
        print(f"  [{event.level}] {event.message}")
    for ckpt in client.fine_tuning.jobs.checkpoints.list(fine_tuning_job_id=job.id):
        print(
            f"  checkpoint {ckpt.fine_tuned_model_checkpoint}: step {ckpt.step_number}, "
            f"train_loss {ckpt.metrics.train_loss:.4f}"
        )
    if job.status != "succeeded":
        print(f"job {job.id} {job.status}: {job.error.message if job.error else ''}")
        return 1
    print(f"fine-tuned model: {job.fine_tuned_model}")
    print(f"trained tokens: {job.trained_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
