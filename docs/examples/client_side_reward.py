"""Your own reward code, run on your side: RL through strop's step API (sample → score locally → train).

strop's services never run a user's code (OpenAI's ``python`` grader is refused, docs/graders.md). Any reward
Python can compute runs here instead, in the client: sample a group of completions per prompt from a snapshot of
the run, score them with ``reward`` below, turn the scores into group-relative advantages (GRPO's, without the
std division: Dr. GRPO), and send them to ``forward_backward`` with the ``importance_sampling`` (or ``ppo``) loss
and the sampler's log-probs, then ``optim_step``.

Run it against a trainer (``strop serve trainer``) that has the model under its model root, with the model's
tokenizer files on this side::

    python docs/examples/client_side_reward.py --address 127.0.0.1:50051 --model tiny-llama \\
        --tokenizer /path/to/tiny-llama --steps 12

tests/graders/test_client_side_reward.py runs it against a real trainer on a tiny model.
"""

from __future__ import annotations

import argparse
import re
import statistics

from strop.client import AdamParams, Datum, RunLora, SamplingParams, TrainerClient
from strop.client.runs import TrainingRun

ROWS = [  # a prompts dataset: chat messages plus the fields your reward reads
    {"messages": [{"role": "user", "content": "What is two plus two?"}], "answer": "4"},
    {"messages": [{"role": "user", "content": "What is three plus four?"}], "answer": "7"},
]


def reward(text: str, row: dict) -> float:
    """The user's reward: any Python at all. Here: half credit for stating a number, full for the row's answer."""
    numbers = re.findall(r"-?\d+", text)
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1] == row["answer"] else 0.5


def prompt_tokens(tokenizer, row: dict) -> list[int]:
    out = tokenizer.apply_chat_template(
        row["messages"], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])


def datums(prompt: list[int], sequences, advantages: list[float]) -> list[Datum]:
    """One datum per completion: the prompt and completion as input, each completion token's advantage and the
    sampler's log-prob of it (the prompt's positions carry advantage 0: they are not trained)."""
    out = []
    for seq, adv in zip(sequences, advantages, strict=True):
        if not seq.tokens:
            continue
        tokens = prompt + seq.tokens
        pad = [0.0] * (len(prompt) - 1)
        out.append(
            Datum.of(
                tokens[:-1],
                target_tokens=tokens[1:],
                logprobs=pad + list(seq.logprobs),
                advantages=pad + [adv] * len(seq.tokens),
            )
        )
    return out


def train(
    run: TrainingRun,
    tokenizer,
    rows: list[dict],
    *,
    steps: int,
    group_size: int = 8,
    max_tokens: int = 4,
    learning_rate: float = 1e-2,
    loss_fn: str = "importance_sampling",
    seed: int = 0,
) -> list[float]:
    """``steps`` RL steps over ``rows``; returns each step's mean reward."""
    means = []
    prompts = [prompt_tokens(tokenizer, r) for r in rows]
    for step in range(steps):
        sampler = run.save_weights_for_sampler().sampler_id  # the weights that sample this step
        batch, rewards_all = [], []
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            params = SamplingParams(max_tokens=max_tokens, seed=seed * 1_000_003 + step * 101 + i)
            out = run.sample(prompt, group_size, params, sampler_id=sampler)
            texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in out.sequences]
            rewards = [reward(t, row) for t in texts]  # ← your code, on your machine
            mean = statistics.fmean(rewards)
            batch += datums(prompt, out.sequences, [r - mean for r in rewards])
            rewards_all += rewards
        run.forward_backward(batch, loss_fn)
        run.optim_step(AdamParams(learning_rate=learning_rate))
        means.append(statistics.fmean(rewards_all))
    return means


def evaluate(
    run: TrainingRun, tokenizer, rows: list[dict], *, n: int = 64, max_tokens: int = 4, seed: int = 1
) -> float:
    """Mean reward of ``n`` samples per row from the run's current weights, at fixed seeds."""
    sampler = run.save_weights_for_sampler().sampler_id
    scores = []
    for i, row in enumerate(rows):
        out = run.sample(
            prompt_tokens(tokenizer, row),
            n,
            SamplingParams(max_tokens=max_tokens, seed=seed + i),
            sampler_id=sampler,
        )
        scores += [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), row) for s in out.sequences]
    return statistics.fmean(scores)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--model", required=True, help="the model's path under the trainer's model root")
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer files on this machine")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--learning-rate", type=float, default=1e-2)
    ap.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "ppo"])
    args = ap.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with TrainerClient(args.address) as client:
        session = client.load_model(args.model)
        run = client.create_training_run(session.session_id, RunLora(rank=8, seed=0, train_unembed=True))
        before = evaluate(run, tokenizer, ROWS, max_tokens=args.max_tokens)
        means = train(
            run,
            tokenizer,
            ROWS,
            steps=args.steps,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            learning_rate=args.learning_rate,
            loss_fn=args.loss,
        )
        after = evaluate(run, tokenizer, ROWS, max_tokens=args.max_tokens)
        print("mean reward per step:", " ".join(f"{m:.3f}" for m in means))
        print(f"held-out mean reward: {before:.3f} before, {after:.3f} after")
        run.delete()
        client.close_session(session.session_id)


if __name__ == "__main__":
    main()
