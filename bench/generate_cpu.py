"""Generate on a CPU session: NF4 (quantized on load, fp32 compute) against the same model in bf16, one process.

The model is SmolLM2-135M-Instruct (``strop.fixtures.smollm2``), each session with a LoRA adapter attached (r 16,
all seven projections), as a session is after AttachLora. The session's Generate (``models.generate``, greedy,
one prompt at a time) answers :data:`PROMPTS` with ``--new-tokens``; the systems take turns, ``--rounds`` times,
and the median is reported:

- ``nf4``: the NF4 session as the trainer runs it (4-bit layers generate from a dequantized copy,
  ``models.inference_weights``);
- ``nf4-bnb``: the same session with the copy switched off (bitsandbytes dequantizes every weight each step);
- ``bf16``: the model loaded 16-bit (``quantization=NONE, dtype=bfloat16``).

    nice -n 10 .venv/bin/python bench/generate_cpu.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

PROMPTS = [
    "What is the capital of France?",
    "Who wrote Hamlet?",
    "What is 2 + 2?",
    "Name a primary color.",
    "What planet is known as the Red Planet?",
    "How many legs does a spider have?",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default="nf4,nf4-bnb,bf16", help="comma-separated, of nf4, nf4-bnb, bf16")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of PROMPTS")
    a = p.parse_args()
    import torch

    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.fixtures.smollm2 import make_smollm2
    from strop.trainer_svc.core import model_loading

    torch.set_num_threads(a.threads)
    model_dir = make_smollm2()
    sessions = {}
    systems = a.systems.split(",")
    prompts = PROMPTS[: a.prompts]
    wanted = {"nf4" if s.startswith("nf4") else s for s in systems}
    for name, quant, dtype in (("nf4", Quantization.NF4, ""), ("bf16", Quantization.NONE, "bfloat16")):
        if name not in wanted:
            continue
        loaded = model_loading.load_model(
            LoadModelRequest(model_path=model_dir.name, quantization=quant, dtype=dtype),
            model_root=model_dir.parent,
            device="cpu",
        )
        model_loading.attach_lora(loaded, LoraConfig(r=16, alpha=16, seed=0))
        sessions[name] = loaded
    real_copy = model_loading._inference_copy

    def run(system: str) -> tuple[float, list[str]]:
        loaded = sessions["nf4" if system.startswith("nf4") else system]
        model_loading._inference_copy = (lambda _: {}) if system == "nf4-bnb" else real_copy
        t0 = time.perf_counter()
        out = model_loading.generate(
            loaded, prompts, max_new_tokens=a.new_tokens, disable_adapter=False, apply_chat_template=True
        )
        return time.perf_counter() - t0, out

    for system in systems:  # warm-up (and the copy built) outside the timings
        run(system)
    times: dict[str, list[float]] = {s: [] for s in systems}
    answers = {}
    for _ in range(a.rounds):
        for system in times:
            dt, answers[system] = run(system)
            times[system].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "commit": commit,
                "cpu": platform.processor() or platform.machine(),
                "threads": a.threads,
                "prompts": len(prompts),
                "new_tokens": a.new_tokens,
                "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
                "median_s": {k: round(v, 2) for k, v in med.items()},
                **{f"{k}_over_bf16": round(v / med["bf16"], 2) for k, v in med.items() if "bf16" in med},
                "answers": answers,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
