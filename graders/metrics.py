"""The ``text_similarity`` grader's evaluation metrics, each a function (input, reference) → score in [0, 1].

OpenAI's graders guide lists the metrics and names only rapidfuzz for ``fuzzy_match``; its python-grader example
(the same guide) scores a fuzzy match as ``fuzz.WRatio(output, reference, processor=utils.default_process) / 100``,
which is what ``fuzzy_match`` computes here. OpenAI's python-grader image ships rapidfuzz, rouge-score 0.1.2 and
nltk, the libraries used here:

- ``fuzzy_match``: rapidfuzz ``fuzz.WRatio`` with ``utils.default_process`` (lower case, non-alphanumerics to
  spaces, trimmed), over 100.
- ``bleu``: NLTK's ``sentence_bleu`` (4-gram, uniform weights) with smoothing method 3 (NIST's geometric sequence,
  the default of sacreBLEU's sentence BLEU: without smoothing any text shorter than four tokens scores 0).
- ``gleu``: NLTK's ``sentence_gleu`` (Google BLEU, Wu et al. 2016: min of n-gram precision and recall, n = 1..4).
- ``meteor``: NLTK's ``meteor_score``; it needs the WordNet corpus, which strop never downloads: refused unless
  NLTK finds it installed (``nltk.data.find("corpora/wordnet")``).
- ``rouge_1`` … ``rouge_5``, ``rouge_l``: rouge-score's ``RougeScorer`` F-measure (its tokenizer: lower case,
  runs of ``[a-z0-9]``, so text in other scripts has no tokens and scores 0; no stemming); ``rouge_l``'s longest
  common subsequence is rapidfuzz's (``rouge_l`` below), the same value in C.
- ``cosine``: refused. It needs an embedding model (OpenAI's is ``text-embedding-3-large``, "only available for
  evals" per the same guide); strop loads no model for it.

BLEU, GLEU and METEOR tokenize with NLTK's ``NLTKWordTokenizer`` (Treebank rules, no data files), case kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

METRICS = (
    "cosine",
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
)


def refusal(metric: str) -> str | None:
    """Why ``metric`` cannot run here, or None when it can."""
    if metric == "cosine":
        return (
            "cosine needs an embedding model (OpenAI's text-embedding-3-large; OpenAI offers it only for evals): "
            "strop loads none, use fuzzy_match, bleu, gleu or rouge_*"
        )
    if metric == "meteor" and not _wordnet_installed():
        return (
            "meteor needs NLTK's WordNet corpus, which is not installed here and which strop never downloads "
            "(install it with nltk.download('wordnet') where the trainer runs, or use bleu, gleu or rouge_*)"
        )
    return None


@functools.cache
def _wordnet_installed() -> bool:
    import nltk

    for name in ("corpora/wordnet", "corpora/wordnet.zip"):
        try:
            nltk.data.find(name)
            return True
        except LookupError:
            continue
    return False


@functools.cache
def _tokenizer():
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def tokens(text: str) -> list[str]:
    return _tokenizer().tokenize(text)


def fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.WRatio(text, reference, processor=utils.default_process) / 100.0


def bleu(text: str, reference: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    hyp, ref = tokens(text), tokens(reference)
    if not hyp or not ref:
        return 0.0
    return float(sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method3))


def gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hyp, ref = tokens(text), tokens(reference)
    if not hyp or not ref:
        return 0.0
    return float(sentence_gleu([ref], hyp))


def meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([tokens(reference)], tokens(text)))


@functools.cache
def _rouge(kind: str):
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([kind], use_stemmer=False)


@functools.cache
def _rouge_tokenizer():
    from rouge_score.tokenizers import DefaultTokenizer

    return DefaultTokenizer(use_stemmer=False)


def rouge_l(text: str, reference: str) -> float:
    """rouge-score's ``rougeL`` F-measure, with the longest common subsequence from rapidfuzz's ``LCSseq`` (C,
    bit-parallel) instead of rouge-score's table filled in Python, which takes seconds for two texts of a few
    thousand words (a GRPO step grades dozens); the same value as rouge-score's (tested against it)."""
    from rapidfuzz.distance import LCSseq

    hyp, ref = _rouge_tokenizer().tokenize(text), _rouge_tokenizer().tokenize(reference)
    if not hyp or not ref:
        return 0.0
    lcs = LCSseq.similarity(hyp, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(hyp), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _rouge_metric(kind: str) -> Callable[[str, str], float]:
    def score(text: str, reference: str) -> float:
        return float(_rouge(kind).score(reference, text)[kind].fmeasure)  # score(target, prediction)

    score.__name__ = kind
    return score


FUNCTIONS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{f"rouge_{n}": _rouge_metric(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": rouge_l,
}
