"""The bundled corpus cut into short documents: packed samples with many documents each, for document masking's tests
and benchmark (the bundled documents are whole books, so a sample of a few thousand tokens is nearly always one).

    python -m data.short_documents --out short.jsonl [--mean-chars 600] [--max-chars 2000000] [--seed 0] [--force]

Each book is cut at sentence ends into documents whose lengths follow an exponential distribution of the given mean
(at least one sentence each), in the corpus's order; the JSON Lines file (`{"text"}` a line) is then tokenized like
any corpus (`python -m data.preprocess --input short.jsonl --tokenizer TOK --out PREFIX`). An existing `--out` is
refused unless `--force`; the file is written whole and renamed into place (a symbolic link there is replaced, never
written through).
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys
from typing import Iterator, List, Optional

from data.config import BUNDLED_CORPUS
from diff_transformer.cli import ArgumentParser, run
from diff_transformer.fileio import atomic_write_lines, check_output

WRITER = "data.short_documents"

SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def short_documents(mean_chars: int = 600, max_chars: Optional[int] = None, seed: int = 0) -> Iterator[str]:
    """Documents of about ``mean_chars`` characters (exponentially distributed) cut from the bundled corpus at
    sentence ends, up to ``max_chars`` characters in all."""
    rng = random.Random(seed)
    written = 0
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            sentences: List[str] = SENTENCE_END.split(json.loads(line)["text"])
            document: List[str] = []
            target = rng.expovariate(1.0 / mean_chars)
            for sentence in sentences:
                document.append(sentence)
                if sum(map(len, document)) >= target:
                    text = " ".join(document)
                    yield text
                    written += len(text)
                    if max_chars is not None and written >= max_chars:
                        return
                    document, target = [], rng.expovariate(1.0 / mean_chars)
            if document:
                text = " ".join(document)
                yield text
                written += len(text)
                if max_chars is not None and written >= max_chars:
                    return


def write_short_documents(path: str, mean_chars: int = 600, max_chars: Optional[int] = None, seed: int = 0) -> int:
    """Write :func:`short_documents` to ``path`` as JSON Lines (atomically); returns how many documents."""
    texts = list(short_documents(mean_chars, max_chars, seed))
    atomic_write_lines(path, (json.dumps({"text": text}) + "\n" for text in texts))
    return len(texts)


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON Lines file to write")
    parser.add_argument("--mean-chars", type=int, default=600, help="mean document length in characters")
    parser.add_argument("--max-chars", type=int, default=None, help="stop after this many characters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    if args.mean_chars < 1:
        parser.error(f"--mean-chars={args.mean_chars} must be at least 1")
    if args.max_chars is not None and args.max_chars < 1:
        parser.error(f"--max-chars={args.max_chars} must be at least 1")
    check_output(args.out, [str(BUNDLED_CORPUS)], WRITER, args.force, directory=False)
    count = write_short_documents(args.out, args.mean_chars, args.max_chars, args.seed)
    print(f"wrote {count:,} documents to {args.out}")


if __name__ == "__main__":
    sys.exit(run(main))
