"""Multiple-choice scoring by log-likelihood, as lm-eval-harness scores its ``multiple_choice`` tasks: each choice is
scored as the sum of its tokens' log-probabilities after the context, and the item counts as right when the answer's
sum is the largest.

    items = read_items("tests/lm_eval_tasks/corpus_cloze.jsonl")   # {"context", "choices", "answer"} per line
    scores = score_multiple_choice(load_for_inference(resolve_run(path)), tokenizer, items)
    scores.accuracy, scores.loglikelihoods

A choice's tokens are those that encoding context + choice adds to the context's own encoding (so a context ending
in a space and a choice starting with one tokenize as the text reads); an empty context is the end-of-document token,
which precedes every document in training.
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Sequence, Tuple

import torch


@dataclasses.dataclass
class ChoiceScores:
    loglikelihoods: List[List[float]]  # per item, per choice: Σ log p(choice tokens | context)
    answers: List[int]

    @property
    def predictions(self) -> List[int]:
        return [max(range(len(lls)), key=lls.__getitem__) for lls in self.loglikelihoods]

    @property
    def accuracy(self) -> float:
        return sum(p == a for p, a in zip(self.predictions, self.answers)) / max(len(self.answers), 1)


def read_items(path: str) -> List[dict]:
    """JSON Lines of ``{"context": str, "choices": [str, ...], "answer": index}``; ValueError naming a bad line."""
    items = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not (isinstance(item.get("choices"), list) and isinstance(item.get("answer"), int)
                    and 0 <= item["answer"] < len(item["choices"]) and isinstance(item.get("context"), str)):
                raise ValueError(f"{path}:{number} is not {{\"context\": str, \"choices\": [str, ...], \"answer\": "
                                 f"index of a choice}}: {line.strip()[:120]}")
            items.append(item)
    return items


def encode_choice(tokenizer, context: str, choice: str) -> Tuple[List[int], List[int]]:
    """(context tokens, choice tokens): the choice's are what encoding context + choice adds to the context's."""
    if not context:
        return [tokenizer.eod], tokenizer.encode(choice)
    context_ids = tokenizer.encode(context)
    return context_ids, tokenizer.encode(context + choice)[len(context_ids):]


def score_multiple_choice(model, tokenizer, items: Sequence[dict]) -> ChoiceScores:
    """Score every choice of every item with ``model.token_nll`` (an InferenceModel)."""
    loglikelihoods = []
    for item in items:
        scores = []
        for choice in item["choices"]:
            context_ids, choice_ids = encode_choice(tokenizer, item["context"], choice)
            tokens = torch.tensor([context_ids + choice_ids])
            nll = model.token_nll(tokens)[0, len(context_ids) - 1:]  # the positions that predict the choice's tokens
            scores.append(-float(nll.double().sum()))
        loglikelihoods.append(scores)
    return ChoiceScores(loglikelihoods, [item["answer"] for item in items])
