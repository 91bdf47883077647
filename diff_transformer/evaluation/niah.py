"""Multi-needle retrieval (needle in a haystack), generated from the tokenizer's vocabulary and a haystack corpus.

A sample of context length L and depth d is L tokens: haystack (a contiguous stretch of the haystack stream,
documents joined by end-of-document tokens as in training) with N needles "The magic number for <key> is <value>."
inserted, followed by R queries "The magic number for <key> is <value>." for R of the N keys. The R asked needles
sit together at depth d of the haystack (0: its start, 1: its end), in random order; the N − R others at uniformly
random depths. Keys are distinct alphabetic pieces of the tokenizer's vocabulary, values distinct random numbers of
``value_digits`` digits. Everything is drawn from ``random.Random(seed)`` per cell, so a seed gives the same samples.

Scoring is teacher-forced: a query is retrieved when the model's most likely next token equals the value's next
token at every value position, which is exactly greedy decoding of the value after the cue (later queries see the
earlier queries' true values). Accuracy is the share of asked needles retrieved. Needle and query spell the value
with the same tokens (the value is tokenized on its own), so retrieval is a pure copy.

The paper's 4K multi-needle anchor (DIFF Transformer, Table 2: N = 6, R = 2 at 4096 tokens, Transformer 0.35 vs
DIFF 0.85 at 3B): ``--needles 6 --asked 2 --lengths 4096`` on a model trained at ``model.seq_length=4096``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

CUE = "The magic number for {key} is"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class NiahConfig:
    needles: int = 6
    asked: int = 2
    lengths: Tuple[int, ...] = ()
    depths: Tuple[float, ...] = DEFAULT_DEPTHS
    samples: int = 10  # per (length, depth) cell
    seed: int = 0
    value_digits: int = 4

    def validate(self, max_length: Optional[int] = None, min_length: Optional[int] = None,
                 length_flag: str = "--lengths") -> None:
        """Refuse bad settings, naming the command's flags (``length_flag``: evaluate's --lengths, analyze's
        --length)."""
        if self.needles < 1 or not 1 <= self.asked <= self.needles:
            raise ValueError(f"--needles {self.needles} --asked {self.asked}: need 1 <= asked <= needles")
        if not self.lengths:
            raise ValueError(f"niah needs at least one context length ({length_flag})")
        for length in self.lengths:
            if max_length is not None and length > max_length:
                raise ValueError(f"niah context length {length} is above the model's maximum sequence length "
                                 f"{max_length} (model.seq_length); use {length_flag} up to {max_length}")
            if min_length is not None and length < min_length:
                raise ValueError(f"niah context length {length} is too short for {self.needles} needles and "
                                 f"{self.asked} queries with this tokenizer (at least {min_length} tokens); use longer "
                                 f"{length_flag} or fewer --needles")
        for depth in self.depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"niah depth {depth} must lie in [0, 1]")
        if self.samples < 1 or self.value_digits < 1:
            raise ValueError(f"--samples {self.samples} and --value-digits {self.value_digits} must be >= 1")


@dataclass
class Needle:
    key: str
    value: str
    span: Tuple[int, int]  # [start, stop) of the needle's tokens in the sample
    asked: bool


@dataclass
class Query:
    needle: int  # index into Sample.needles
    span: Tuple[int, int]  # [start, stop) of the whole query sentence
    answer: Tuple[int, int]  # [start, stop) of the value's tokens: the positions that must be predicted


@dataclass
class Sample:
    tokens: List[int]
    length: int
    depth: float
    needles: List[Needle]
    queries: List[Query]
    haystack_mask: List[bool] = field(default_factory=list)  # True on haystack tokens


def key_pieces(tokenizer, minimum_letters: int = 4) -> List[str]:
    """Alphabetic pieces of the vocabulary (a leading word-boundary marker dropped), lower-cased, sorted."""
    pieces = set()
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i]).strip()
        if len(text) >= minimum_letters and text.isascii() and text.isalpha():
            pieces.add(text.lower())
    if len(pieces) < 2:
        raise ValueError(f"the tokenizer at {tokenizer.path} has too few alphabetic pieces to make needle keys")
    return sorted(pieces)


class NeedleFactory:
    """Token sequences of needles and queries for one tokenizer."""

    def __init__(self, tokenizer, value_digits: int):
        self.tokenizer = tokenizer
        self.value_digits = value_digits
        self.keys = key_pieces(tokenizer)
        self.period = tokenizer.encode(".")
        self.newline = tokenizer.encode("\n")

    def draw(self, rng: random.Random, count: int) -> List[Tuple[str, str]]:
        keys = rng.sample(self.keys, min(count, len(self.keys)))
        if len(keys) < count:
            raise ValueError(f"{count} needles need {count} distinct keys; the vocabulary has {len(self.keys)}")
        values: List[str] = []
        while len(values) < count:
            value = str(rng.randrange(10 ** (self.value_digits - 1), 10 ** self.value_digits))
            if value not in values:
                values.append(value)
        return list(zip(keys, values))

    def longest_sentence(self) -> int:
        """Tokens of the longest needle or query sentence any key makes (values all tokenize to the same length
        with digit-by-digit vocabularies; the longest value is used otherwise)."""
        value = "9" * self.value_digits
        return max(len(self.sentence(key, value)[0]) for key in self.keys)

    def minimum_length(self, needles: int, asked: int) -> int:
        """The shortest context that holds every draw of needles and queries, and one haystack token."""
        return (needles + asked) * self.longest_sentence() + 1

    def sentence(self, key: str, value: str) -> Tuple[List[int], Tuple[int, int]]:
        """Tokens of "\\n<cue> <value>." and the [start, stop) of the value inside them."""
        cue = self.newline + self.tokenizer.encode(CUE.format(key=key))
        value_tokens = self.tokenizer.encode(" " + value)
        return cue + value_tokens + self.period, (len(cue), len(cue) + len(value_tokens))


def needles_length(factory: NeedleFactory, pairs: Sequence[Tuple[str, str]], asked: int) -> int:
    return sum(len(factory.sentence(k, v)[0]) for k, v in pairs) + sum(
        len(factory.sentence(k, v)[0]) for k, v in pairs[:asked])


def make_sample(factory: NeedleFactory, haystack: np.ndarray, length: int, depth: float, needles: int, asked: int,
                rng: random.Random, length_flag: str = "--lengths") -> Sample:
    pairs = factory.draw(rng, needles)
    sentences = [factory.sentence(k, v) for k, v in pairs]
    order = list(range(needles))
    rng.shuffle(order)
    asked_ids = order[:asked]  # needles asked for, in the order the queries ask them
    query_tokens = sum(len(sentences[i][0]) for i in asked_ids)
    haystack_len = length - sum(len(s[0]) for s in sentences) - query_tokens
    if haystack_len < 1:
        raise ValueError(f"niah context length {length} is too short for {needles} needles and {asked} queries "
                         f"({length - haystack_len + 1} tokens at least with this tokenizer); use longer "
                         f"{length_flag} or fewer --needles")
    start = rng.randrange(0, len(haystack) - haystack_len + 1)
    hay = [int(t) for t in haystack[start:start + haystack_len]]
    # insertion points in the haystack: the asked block at depth d, the others uniform
    inserts: Dict[int, List[int]] = {}
    block = asked_ids[:]
    rng.shuffle(block)
    inserts.setdefault(round(depth * haystack_len), []).extend(block)
    for i in order[asked:]:
        inserts.setdefault(rng.randrange(0, haystack_len + 1), []).append(i)
    tokens: List[int] = []
    haystack_mask: List[bool] = []
    spans: Dict[int, Tuple[int, int]] = {}
    for position in range(haystack_len + 1):
        for i in inserts.get(position, []):
            spans[i] = (len(tokens), len(tokens) + len(sentences[i][0]))
            tokens += sentences[i][0]
            haystack_mask += [False] * len(sentences[i][0])
        if position < haystack_len:
            tokens.append(hay[position])
            haystack_mask.append(True)
    queries = []
    for i in asked_ids:
        sentence, (a, b) = sentences[i]
        queries.append(Query(i, (len(tokens), len(tokens) + len(sentence)), (len(tokens) + a, len(tokens) + b)))
        tokens += sentence
        haystack_mask += [False] * len(sentence)
    assert len(tokens) == length
    needle_list = [Needle(k, v, spans[i], i in asked_ids) for i, (k, v) in enumerate(pairs)]
    return Sample(tokens, length, depth, needle_list, queries, haystack_mask)


def generate(config: NiahConfig, tokenizer, haystack: np.ndarray, length_flag: str = "--lengths") -> List[Sample]:
    """Every sample of every (length, depth) cell; the same for the same seed, tokenizer and haystack."""
    factory = NeedleFactory(tokenizer, config.value_digits)
    if len(haystack) < max(config.lengths):
        raise ValueError(f"the haystack holds {len(haystack)} tokens, fewer than the longest context "
                         f"{max(config.lengths)}")
    samples = []
    for length in config.lengths:
        for depth in config.depths:
            rng = random.Random(f"{config.seed}/{length}/{depth}")
            samples += [make_sample(factory, haystack, length, depth, config.needles, config.asked, rng,
                                    length_flag)
                        for _ in range(config.samples)]
    return samples


# ------------------------------------------------------------------------------------------------------------------
# Scoring
# ------------------------------------------------------------------------------------------------------------------
Predictor = Callable[[torch.Tensor], torch.Tensor]  # (b, L) token ids -> (b, L) predicted next token at each position


def retrieved(sample: Sample, predictions: Sequence[int]) -> List[bool]:
    """For each query of the sample: is every value token predicted from the position before it?"""
    return [all(int(predictions[t - 1]) == sample.tokens[t] for t in range(*q.answer)) for q in sample.queries]


def score(samples: Sequence[Sample], predict: Predictor, batch_size: int = 8) -> List[List[bool]]:
    """retrieved() of every sample under ``predict``; samples of equal length are batched."""
    results: List[Optional[List[bool]]] = [None] * len(samples)
    for indices in _batches(samples, batch_size):
        tokens = torch.tensor([samples[i].tokens for i in indices])
        predictions = predict(tokens).cpu()
        for row, i in enumerate(indices):
            results[i] = retrieved(samples[i], predictions[row].tolist())
    return results  # type: ignore[return-value]


def _batches(samples: Sequence[Sample], batch_size: int):
    by_length: Dict[int, List[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault(s.length, []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            yield indices[start:start + batch_size]


def accuracy_grid(config: NiahConfig, samples: Sequence[Sample], results: Sequence[Sequence[bool]]) -> List[List[float]]:
    """Mean share of asked needles retrieved, [length][depth]."""
    grid = []
    for length in config.lengths:
        row = []
        for depth in config.depths:
            cell = [np.mean(r) for s, r in zip(samples, results) if s.length == length and s.depth == depth]
            row.append(float(np.mean(cell)))
        grid.append(row)
    return grid


def induction_oracle(tokens: torch.Tensor) -> torch.Tensor:
    """A perfect copier: at each position, the token that followed the longest earlier occurrence of the text ending
    there (the latest one on ties); the token itself when nothing earlier matches. Reads only the prompt."""
    out = tokens.clone()
    for b, row in enumerate(tokens.tolist()):
        for p in range(len(row)):
            best, best_next = 0, row[p]
            for q in range(p - 1, -1, -1):
                n = 0
                while n <= q and row[q - n] == row[p - n]:
                    n += 1
                if n > best:
                    best, best_next = n, row[q + 1]
            out[b, p] = best_next
    return out


# ------------------------------------------------------------------------------------------------------------------
# Attention allocation (the paper's Figure 1 / Table 3 measure)
# ------------------------------------------------------------------------------------------------------------------
REGIONS = ("answer", "distractors", "haystack", "queries")


def region_masks(sample: Sample, query: Query) -> Dict[str, torch.Tensor]:
    """Key masks (L,) of the regions a query's answer rows can attend to: the asked needle's sentence (``answer``),
    the other needles, the haystack, and the queries (earlier ones and this one's cue)."""
    L = sample.length
    answer = torch.zeros(L, dtype=torch.bool)
    answer[slice(*sample.needles[query.needle].span)] = True
    distractors = torch.zeros(L, dtype=torch.bool)
    for i, needle in enumerate(sample.needles):
        if i != query.needle:
            distractors[slice(*needle.span)] = True
    haystack = torch.tensor(sample.haystack_mask, dtype=torch.bool)
    queries = ~(answer | distractors | haystack)
    return {"answer": answer, "distractors": distractors, "haystack": haystack, "queries": queries}


def answer_rows(query: Query) -> torch.Tensor:
    """The positions whose next-token prediction is a value token."""
    return torch.arange(query.answer[0] - 1, query.answer[1] - 1)
