"""Keeping what the base model knows while an adapter learns new facts: replay, and the forgetting metric.

A few dozen rows of new facts trained for many epochs overwrite nearby knowledge: taught that the capital of an
invented country is an invented city, a small model answers "What is the capital of France?" with that city too
(issue 31: SmolLM2-135M-Instruct lost 4 of 4 general answers it had right). Two pieces, both on the session's own
model, nothing downloaded:

- **Replay** (``Retention.REPLAY``): before training, the base (the adapter disabled) answers general prompts
  greedily (:data:`REPLAY_PROMPTS`); those conversations are mixed into the training rows, so every epoch also
  teaches the model to keep answering them as the base does. The answers are the base's own, right or wrong:
  replay keeps behaviour, it teaches nothing new (the same idea as rehearsal with self-generated samples,
  e.g. Sun et al., LAMOL, ICLR 2020; and as "replay of the model's own answers" in the fine-tuning guides).
- **A KL term to the base** (``retention_kl`` > 0, with REPLAY): every training step also adds that weight times
  KL(base ‖ model) over the next batch of replayed answers' next-token distributions (:class:`ReplayKL`; the
  chunked loss is ``kernels/losses/kl.py``), the base being the model with its adapter disabled, as DPO's
  reference is in strop. Distillation of the base's whole distribution where replay's cross-entropy keeps only
  its greedy token.
- **The KL term alone** (``Retention.KL``): the base answers the same prompts, and each step adds the KL term
  (weight ``retention_kl``) over a batch of those answers, which stay out of the cross-entropy: trained on as
  targets for many epochs, replayed answers become facts of their own and spread into neighbouring questions as
  the invented facts do (bench/RESULTS.md, "The facts recipe with sentence-cut replay"); the KL pulls the model's
  distribution back to the base's without sharpening the base's greedy answers. Unfinished answers are scored too
  (:func:`kl_rows`): the KL matches the base's distribution at every position, so a cut answer teaches no stop, and
  the prompts the base answers at length are the facts' own question forms.
- **The forgetting metric** (every SFT job of a session with a chat template): the base answers the held-out
  prompts :data:`HELD_OUT_PROMPTS` (disjoint from the replay prompts) before training; after training the
  adapted model is run teacher-forced on those answers. ``kept`` counts the answers whose every token is still
  the model's top-1 choice: exactly the answers greedy decoding would still reproduce word for word (ties
  aside). It is reported as a job event (``RetentionMetrics``) with the token agreement and the mean NLL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("strop.trainer")

# General prompts the base answers for replay. Short factual questions and small instructions across the kinds
# of knowledge a facts dataset tends to overwrite (capitals, people, science, numbers, words); none of them is a
# held-out prompt (a test checks the two sets are disjoint).
REPLAY_PROMPTS: tuple[str, ...] = (
    "What is the capital of Germany?",
    "What is the capital of Italy?",
    "What is the capital of Spain?",
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "What is the capital of Egypt?",
    "What is the capital of Russia?",
    "What is the capital of China?",
    "What is the capital of the United Kingdom?",
    "What is the capital of Greece?",
    "What is the capital of Portugal?",
    "What is the capital of Ireland?",
    "Which country is Paris in?",
    "Which continent is Brazil in?",
    "What is the largest ocean on Earth?",
    "What is the longest river in Africa?",
    "What is the tallest mountain in the world?",
    "Who wrote Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "Who developed the theory of relativity?",
    "Who was the first president of the United States?",
    "Who discovered penicillin?",
    "What is the chemical symbol for water?",
    "What is the chemical symbol for gold?",
    "What gas do plants absorb from the air?",
    "What planet is known as the Red Planet?",
    "What is the closest star to Earth?",
    "How many planets are in the solar system?",
    "What is the boiling point of water in Celsius?",
    "What is the freezing point of water in Celsius?",
    "How many legs does a spider have?",
    "How many days are in a week?",
    "How many months are in a year?",
    "How many hours are in a day?",
    "What is 2 + 2?",
    "What is 10 times 10?",
    "What is 9 minus 4?",
    "What is half of 100?",
    "What color is the sky on a clear day?",
    "What color are bananas when they are ripe?",
    "What do bees make?",
    "What animal is known as the king of the jungle?",
    "What is the largest mammal?",
    "What is the opposite of hot?",
    "What is the plural of mouse?",
    "What language is spoken in Brazil?",
    "What currency is used in Japan?",
    "What is the main ingredient of bread?",
    "Name a primary color.",
    "What is the square root of 16?",
    "Which organ pumps blood through the body?",
    "What do you call a baby cat?",
    "How many sides does a triangle have?",
    "What is the first letter of the English alphabet?",
    "Translate 'thank you' into French.",
    "Give me a synonym for happy.",
    "Write one sentence about the sun.",
    "What is the capital of Australia?",
    "What is the capital of India?",
    "Who wrote Hamlet?",
    "What is H2O commonly called?",
    "What is the hardest natural substance?",
    "Which planet is the largest in the solar system?",
    "In which year did World War II end?",
    # The forms a user's facts take (who invented / founded / wrote / painted / discovered, colours, what an animal
    # eats, how many legs, heights and lengths, dates, currencies, dishes, symbols, sports, instruments, the
    # largest or fastest of a kind), asked about real things: facts of one form taught alone leak their invented
    # names into every question of that form (bench/RESULTS.md, "Teaching facts")
    "Who invented the light bulb?",
    "Who invented the printing press?",
    "Who invented the airplane?",
    "Who founded Microsoft?",
    "Who founded the Red Cross?",
    "Who wrote The Odyssey?",
    "Who wrote War and Peace?",
    "Who painted The Last Supper?",
    "Who painted the ceiling of the Sistine Chapel?",
    "Who discovered gravity?",
    "Who discovered radium?",
    "What color is snow?",
    "What colour is a polar bear?",
    "What color is a ripe tomato?",
    "What color are leaves in summer?",
    "What do pandas eat?",
    "What do cows eat?",
    "How many legs does an insect have?",
    "How many legs does a bird have?",
    "How tall is Mount Everest?",
    "How long is the Nile River?",
    "Where does the Amazon River flow into?",
    "When was the Declaration of Independence signed?",
    "When did the Titanic sink?",
    "What is the currency of the United States?",
    "What is the currency of the United Kingdom?",
    "What language is spoken in France?",
    "What is the national dish of Italy?",
    "What is the chemical symbol for oxygen?",
    "What is the chemical symbol for sodium?",
    "What is the boiling point of water in Fahrenheit?",
    "What is the motto of the United States?",
    "What sport is played at Wimbledon?",
    "What sport is played in the NBA?",
    "What instrument did Beethoven play?",
    "What instrument did Louis Armstrong play?",
    "What is the largest continent?",
    "What is the largest lake in Africa?",
    "What is the largest city in the United States?",
    "What is the fastest land animal?",
    "What is the fastest bird in the world?",
    "What is NASA?",
    "What is the capital of Argentina?",
    "What is the capital of Kenya?",
    "What is the capital of South Korea?",
    "What is the capital of the Netherlands?",
)

# The forgetting metric's prompts: never replayed.
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "What is the capital of Mexico?",
    "What is the capital of Sweden?",
    "What is the capital of Norway?",
    "Who wrote Pride and Prejudice?",
    "Who invented the telephone?",
    "What is the chemical symbol for iron?",
    "What planet do we live on?",
    "How many continents are there?",
    "What is 3 + 5?",
    "How many legs does a dog have?",
    "What color is grass?",
    "What is the largest desert in the world?",
    "What is the opposite of up?",
    "What language is spoken in Germany?",
    "What is the capital of Poland?",
)

# An answer not finished by then is left out: cut mid-sentence it would teach stopping there; cut at its last
# complete sentence it kept fewer general answers (bench/RESULTS.md, "The facts recipe with sentence-cut replay"):
# the base's long answers are often wrong or odd, and trained for many epochs they spread into neighbouring
# questions as the facts do.
REPLAY_MAX_NEW_TOKENS = 64

# Neighbour questions (``retention_neighbours``): a training question's first words start a user message the base
# continues; the rest of the facts' question ("What instrument did" → "… Beethoven play?") is the base's own.
# Every distinct start of each of these lengths (in words) is continued; the base samples at this temperature and
# nucleus. A 4-word start is a short question's form up to its subject ("How many legs does", "What colour is a"),
# so the base writes questions of exactly the forms a facts dataset overwrites; 2- and 3-word starts add broader
# ones. At 1.0 / 1.0 (the base's own distribution) a small base's samples are often not questions of the form.
# Chosen with bench/recipe_facts.py against 3-word starts at 1.0 / 1.0 (bench/RESULTS.md, "the facts recipe").
NEIGHBOUR_PREFIX_WORDS: tuple[int, ...] = (2, 3, 4)
NEIGHBOUR_TEMPERATURE = 0.7
NEIGHBOUR_TOP_P = 0.9
NEIGHBOUR_MAX_NEW_TOKENS = 24
MAX_NEIGHBOUR_PREFIXES = 64  # distinct prefixes a job samples from (a large dataset's first 64)
# Samples drawn a prefix for each question kept of it: the base's likeliest continuations of a common form ("What is
# the capital" → "… of France?") are often the held-out or replay prompts, which are excluded, or repeats, so with
# one draw a question a common form keeps few; drawing more and keeping the first ``per_prefix`` new ones gives each
# form up to that many questions. Chosen with bench/recipe_facts.py against 1 (bench/RESULTS.md, "four draws a
# neighbour question kept").
NEIGHBOUR_OVERSAMPLE = 4


@dataclass
class BaseAnswers:
    prompts: list[str]
    answers: list[str]
    finished: list[bool]
    seconds: float


def base_answers(
    loaded, prompts: list[str] | tuple[str, ...], *, max_new_tokens: int = REPLAY_MAX_NEW_TOKENS
):
    """The base's greedy answers (adapter disabled) to ``prompts`` as user messages, in one batched decoding pass,
    and whether each ended its turn within ``max_new_tokens``."""
    from strop.trainer_svc.core import model_loading

    t0 = time.perf_counter()
    answers, finished = model_loading.generate_chat_batch(
        loaded, list(prompts), max_new_tokens=max_new_tokens, disable_adapter=True
    )
    return BaseAnswers(list(prompts), answers, finished, time.perf_counter() - t0)


def neighbour_prompts(
    loaded, questions: list[str], per_prefix: int, *, seed: int, exclude: set[str]
) -> list[str]:
    """Questions of the training questions' forms about other things, written by the base (adapter disabled): each
    distinct prefix of ``questions`` of ``NEIGHBOUR_PREFIX_WORDS`` words (the first ``MAX_NEIGHBOUR_PREFIXES``) starts
    a user message, which the base continues ``per_prefix`` × ``NEIGHBOUR_OVERSAMPLE`` times (sampled at
    ``NEIGHBOUR_TEMPERATURE`` and ``NEIGHBOUR_TOP_P``, seeded by ``seed``; the global RNG untouched) up to its first
    "?", of which the first ``per_prefix`` new questions are kept. In order, without repeats; none of ``exclude`` and
    no continuation that reaches a newline or the token limit before its "?"."""
    import torch

    from strop.trainer_svc.core import generation

    tok = loaded.tokenizer
    prefixes: list[str] = []
    for q in questions:
        words = q.split()
        for n in NEIGHBOUR_PREFIX_WORDS:
            prefix = " ".join(words[:n])
            if len(words) > n and prefix not in prefixes:
                prefixes.append(prefix)
    prefixes = prefixes[:MAX_NEIGHBOUR_PREFIXES]
    if not prefixes or per_prefix < 1:
        return []
    mark = "\u2063"  # where the user's text would go on: the template's text up to it is the prompt
    texts, kept = [], []
    for prefix in prefixes:
        full = tok.apply_chat_template([{"role": "user", "content": prefix + mark}], tokenize=False)
        if mark in full:  # a template that rewrites the user's text gives no prompt to continue
            texts.append(full[: full.index(mark)])
            kept.append(prefix)
    prefixes = kept
    if not prefixes:
        return []
    draws = max(1, NEIGHBOUR_OVERSAMPLE)
    dev = torch.device(loaded.device)
    side = tok.padding_side
    try:
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        with (
            torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []),
            generation.inference(loaded, disable_adapter=True) as model,
        ):
            torch.manual_seed(seed)
            out = model.generate(
                **enc,
                max_new_tokens=NEIGHBOUR_MAX_NEW_TOKENS,
                do_sample=True,
                temperature=NEIGHBOUR_TEMPERATURE,
                top_k=0,
                top_p=NEIGHBOUR_TOP_P,
                num_return_sequences=per_prefix * draws,
                pad_token_id=tok.pad_token_id,
                use_cache=True,
            )
    finally:
        tok.padding_side = side
    found: list[str] = []
    of_prefix = [0] * len(prefixes)
    for i, row in enumerate(out[:, enc["input_ids"].shape[1] :]):
        at = i // (per_prefix * draws)
        if of_prefix[at] >= per_prefix:
            continue
        text = tok.decode(row, skip_special_tokens=True)
        end = text.find("?")
        if end < 0 or "\n" in text[:end]:
            continue
        question = prefixes[at] + text[: end + 1]
        if question not in exclude and question not in found:
            found.append(question)
            of_prefix[at] += 1
    return found


def replay_rows(base: BaseAnswers, count: int) -> list[dict]:
    """Up to ``count`` replay conversations (messages rows) from the base's finished answers, in prompt order."""
    rows = []
    for prompt, answer, done in zip(base.prompts, base.answers, base.finished, strict=True):
        if done and answer.strip() and len(rows) < count:
            rows.append(
                {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            )
    return rows


def kl_rows(base: BaseAnswers, count: int) -> list[dict]:
    """Up to ``count`` conversations (messages rows) for the KL term alone, in prompt order: every non-empty answer,
    finished or cut at the token limit (the term matches the base's own distribution on it, so the cut is no
    target)."""
    rows = []
    for prompt, answer in zip(base.prompts, base.answers, strict=True):
        if answer.strip() and len(rows) < count:
            rows.append(
                {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            )
    return rows


@dataclass
class Forgetting:
    """The forgetting metric over held-out prompts (see the module docstring)."""

    held_out: int
    kept: int
    token_agreement: float
    mean_nll: float


def answer_hits(loaded, base: BaseAnswers, *, disable_adapter: bool) -> list[tuple[int, int, float] | None]:
    """Teacher-forced on each finished answer of ``base``: (top-1 hits, answer tokens, summed NLL); None for an
    unfinished answer. The answer's tokens run to its end of turn (what greedy decoding reproduces)."""
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} if done else None
        for p, a, done in zip(base.prompts, base.answers, base.finished, strict=True)
    ]
    hits = iter(
        conversation_hits(loaded, [r for r in rows if r is not None], disable_adapter=disable_adapter)
    )
    return [None if r is None else next(hits)[0] for r in rows]


def conversation_hits(
    loaded, rows: list[dict], *, disable_adapter: bool = False, last_only: bool = False, max_length: int = 0
) -> list[tuple[tuple[int, int, float], list[bool]]]:
    """Teacher-forced on each conversation (messages rows, with the row's own ``tools``): over the tokens of its
    assistant messages (``job_config.assistant_masked``; ``last_only``: the last message's), each cut at its end of
    turn (what greedy decoding reproduces; the template's text after it is not generated), (top-1 hits, tokens,
    summed NLL), and for each assistant message whether every one of its tokens is the model's top-1 (the message
    reproduced word for word).
    One conversation at a time (no padding), cut at ``max_length`` tokens as training cuts it (0: whole), the LM
    head run at the measured positions only (``logits_to_keep``: no sequence × vocabulary logits), as Generate
    computes (``generation.inference``: the session's autocast, fp32 logits); adapter on unless
    ``disable_adapter``."""
    import torch

    from strop.trainer_svc.core import generation, job_config

    tok = loaded.tokenizer
    out: list[tuple[tuple[int, int, float], list[bool]]] = []
    with generation.inference(loaded, disable_adapter=disable_adapter) as model:
        for conv in rows:
            row = job_config.assistant_masked(
                conv["messages"], tok, tools=conv.get("tools"), last_only=last_only
            )
            input_ids = row["input_ids"][:max_length] if max_length else row["input_ids"]
            target = input_ids[1:]
            spans = _turn_spans(row["completion_mask"][1 : len(input_ids)], target, tok.eos_token_id)
            if not spans:
                out.append(((0, 0, 0.0), []))
                continue
            at = [i for a, b in spans for i in range(a, b)]  # position i predicts token i + 1
            ids = torch.tensor([input_ids], device=loaded.device)
            keep = torch.tensor(at, device=loaded.device)
            logits = model(input_ids=ids, logits_to_keep=keep).logits[0].float()
            want = ids[0, keep + 1]
            hit = (logits.argmax(-1) == want).tolist()
            right = dict(zip(at, hit, strict=True))
            nll = float(torch.nn.functional.cross_entropy(logits, want, reduction="sum"))
            whole = [all(right[i] for i in range(a, b)) for a, b in spans]
            out.append(((sum(hit), len(at), nll), whole))
    return out


def _turn_spans(mask: list[int], target: list[int], eos: int | None) -> list[tuple[int, int]]:
    """The [start, end) runs of ``mask``'s ones, each ended just after its first ``eos`` target if it has one."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            end = i
            for j in range(start, i):
                if target[j] == eos:
                    end = j + 1
                    break
            spans.append((start, end))
            start = None
    return spans


def reproducible(base: BaseAnswers, hits: list[tuple[int, int, float] | None]) -> BaseAnswers:
    """The answers the base itself gives word for word unbatched (batched decoding can flip a near tie)."""
    keep = [h is not None and h[0] == h[1] for h in hits]
    pick = [i for i, k in enumerate(keep) if k]
    return BaseAnswers(
        [base.prompts[i] for i in pick], [base.answers[i] for i in pick], [True] * len(pick), base.seconds
    )


def forgetting(loaded, held_out: BaseAnswers) -> Forgetting:
    """The metric on the current model (adapter on) against the base's reproducible held-out answers."""
    hits = [h for h in answer_hits(loaded, held_out, disable_adapter=False) if h is not None]
    agree, total = sum(h[0] for h in hits), sum(h[1] for h in hits)
    return Forgetting(
        held_out=len(hits),
        kept=sum(h[0] == h[1] for h in hits),
        token_agreement=agree / total if total else 0.0,
        mean_nll=sum(h[2] / h[1] for h in hits) / len(hits) if hits else 0.0,
    )


# A step's KL batch may grow past the job's batch size so that every scored answer comes round once an epoch, up to
# this many times the batch size (its cost: that many more rows' forward and backward a step, which matters only
# when the training rows are few: with many rows every answer comes round within an epoch at the job's batch size).
# Chosen with bench/recipe_facts.py against the job's batch size (bench/RESULTS.md, "the facts recipe").
MAX_KL_BATCH_FACTOR = 8

# The lead hinge beside the KL (``kernels.losses.kl.token_kl``'s ``lead_weight``/``lead_cap``: relu(min(base lead, cap)
# − model's lead) on the base's top token at each scored answer token, this weight relative to the KL's). What the
# facts recipe lost were the base's near ties of the facts' forms, which the KL barely prices when they flip; the
# hinge prices them (its measurement with bench/recipe_facts.py: bench/RESULTS.md, issue 31).
LEAD_HINGE = 1.0
LEAD_CAP = 1.0
# The least lead the hinge protects (``lead_floor``, nats): 0 protects the base's own lead however small. With bf16
# logits a base's greedy answer can rest on a tie broken by the token's index; a floor asks the model to lead there
# by a margin, on the answer's own token (which a tie leaves the top-k's choice). Off until measured
# (bench/recipe_facts.py --setting retention.LEAD_FLOOR=F).
LEAD_FLOOR = 0.0


def kl_batch(scored: int, training_rows: int, batch_size: int) -> int:
    """How many of the ``scored`` base answers the KL term scores with each batch of ``batch_size`` training rows:
    enough that each comes round once an epoch, as each training row does, never fewer than ``batch_size`` and at
    most ``MAX_KL_BATCH_FACTOR`` times it. A batch of the job's size alone would leave each of many answers unscored
    for most of an epoch when they outnumber the training rows (30 facts against 110 answers: 8 steps an epoch
    score 32 of them), and what drifts meanwhile is pulled back only when its batch comes round again."""
    per_epoch = -(-max(training_rows, 1) // batch_size)  # training batches an epoch
    need = -(-scored // per_epoch)
    return max(batch_size, min(need, MAX_KL_BATCH_FACTOR * batch_size))


class ReplayKL:
    """The KL term (``retention_kl``, and retention KL): each training step also scores the next ``batch``
    conversations of the base's answers (:func:`kl_batch`), KL(base ‖ model) over their answers' next-token distributions
    (``kernels.losses.kl.token_kl``), the base being the same model with its adapter disabled. Replay's cross-entropy on the base's greedy answers keeps only each
    answer's top token; the KL keeps the whole distribution the base had there.

    The base's hidden states for a batch are computed the first time the batch comes round, in the trainer's own
    forward context (autocast, train mode: with the adapter disabled nothing in a LoRA layer is random), and kept:
    the base never changes. Batches are the rows in order, right-padded, the same batches every epoch."""

    def __init__(self, rows: list[dict], tokenizer, coef: float, batch: int, device) -> None:
        import torch

        from strop.trainer_svc.core import job_config

        self.coef, self.batches, self.teacher, self.turn = coef, [], {}, 0
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        masked = [job_config.assistant_masked(r["messages"], tokenizer) for r in rows]
        for i in range(0, len(masked), batch):
            group = masked[i : i + batch]
            width = max(len(g["input_ids"]) for g in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            attn = torch.zeros((len(group), width), dtype=torch.long)
            scored = torch.zeros((len(group), width - 1), dtype=torch.bool)
            for j, g in enumerate(group):
                n = len(g["input_ids"])
                ids[j, :n] = torch.tensor(g["input_ids"])
                attn[j, :n] = 1
                # position t's hidden state scores token t + 1: an answer token's prediction
                scored[j, : n - 1] = torch.tensor(g["completion_mask"][1:], dtype=torch.bool)
            # the scored positions as flat indices into the [rows · width] hidden states, in the mask's row-major
            # order: a gather by them is the boolean index's values without its device-to-host sync each step
            at = scored.nonzero()
            self.batches.append((ids.to(device), attn.to(device), (at[:, 0] * width + at[:, 1]).to(device)))

    def loss(self, peft_model):
        """coef × the mean KL per answer token of the next batch, differentiable in the adapter."""
        import torch

        from strop.kernels.losses.kl import token_kl

        k = self.turn % len(self.batches)
        self.turn += 1
        ids, attn, at = self.batches[k]
        hf = peft_model.get_base_model()
        decoder, head = hf.get_decoder(), hf.get_output_embeddings()

        def hidden():
            out = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            return out.reshape(-1, out.shape[-1]).index_select(0, at)

        if k not in self.teacher:
            with torch.no_grad(), peft_model.disable_adapter():
                self.teacher[k] = hidden()
        softcap = getattr(hf.config.get_text_config(), "final_logit_softcapping", None)
        student = hidden()
        kl = token_kl(
            student,
            self.teacher[k].to(student.dtype),
            head.weight,
            head.bias,
            softcap=softcap,
            lead_weight=LEAD_HINGE,
            lead_cap=LEAD_CAP,
            lead_floor=LEAD_FLOOR,
            # with a floor, the token the base's greedy answer chose (under a bf16 tie its top token is undecided)
            lead_tokens=ids.reshape(-1).index_select(0, at + 1) if LEAD_FLOOR else None,
        )
        return self.coef * kl


def add_replay_kl(trainer, kl: ReplayKL) -> None:
    """Make ``trainer`` (a TRL SFT trainer, any strop subclass) add ``kl``'s term to every training step's loss;
    evaluation's loss stays the trainer's own. A step graph (``kernels/trainers/sft.py``'s ``GraphedSFTSteps``) runs
    the rows' forward and backward as its graph and this term after it, eagerly (``_strop_added_loss``): the two
    backward passes add into the same gradients, as the backward of their sum does."""

    from strop.kernels.trainers import unwrapped_model
    from strop.kernels.trainers.sft import loss_scaled_for_accumulation

    def term(self, model):
        # under the mixed precision the model's own forward runs in: accelerate wraps only ``model.forward`` in
        # autocast (HF's Trainer adds none), and this term calls the decoder directly
        with self.accelerator.autocast():
            return kl.loss(unwrapped_model(self.accelerator, model))

    class ReplayKLTrainer(type(trainer)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not model.training:
                return out
            t = term(self, model)
            # the trainer divides an unscaled loss by the accumulation steps itself
            if loss_scaled_for_accumulation(self, num_items_in_batch):
                t = t / self.current_gradient_accumulation_steps
            # the term trains (its gradient is added) but the loss the step reports stays the rows' own, the
            # quantity evaluation's loss measures on held-out rows: the KL and its lead hinge are 0 at the first step
            # and grow as the adapter moves (the hinge at first order), which a reported sum would show as a rise
            t = t - t.detach()
            return (out[0] + t, *out[1:]) if return_outputs else out + t

        def _strop_added_loss(self, model):
            """The term as one micro-step's share of the step (divided by the accumulation steps, as HF's step
            divides the sum or ``compute_loss`` divides the term), for a step graph to backpropagate on its own."""
            return term(self, model) / self.current_gradient_accumulation_steps

    trainer.__class__ = ReplayKLTrainer
