"""Tokenizers: train a sentencepiece model on corpus files, load it (or a foreign one) for preprocessing and training.

    python -m data.tokenizer train --input FILES --vocab-size V --out DIR [--model-type bpe|unigram]
        [--no-byte-fallback] [--special-tokens TOK ...] [--max-sentences N] [--text-field text] [--preset NAME]
    python -m data.tokenizer import --model PATH --out DIR      # an existing sentencepiece .model

A tokenizer directory holds `tokenizer.model` (sentencepiece) and `tokenizer_config.json` (library, vocab size, special
ids, sha256 of the model). `load_tokenizer` also takes a bare sentencepiece `.model`, a Hugging Face `tokenizer.json`
(needs the `tokenizers` package) or a `.tiktoken` BPE file (needs `tiktoken`).

The trained models are lossless: identity normalisation, whitespace kept, newline a token of its own and byte fallback
for characters outside the vocabulary, so `decode(encode(text)) == text` for any text.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from data import readers
from diff_transformer.cli import ArgumentParser, run
from diff_transformer.fileio import check_output, replace_directory, staging_directory

WRITER = "data.tokenizer"  # the mark of the tokenizer directories it writes: a rerun may replace them
MODEL_FILE = "tokenizer.model"
CONFIG_FILE = "tokenizer_config.json"
# unk, bos, eos (the end-of-document token), pad: fixed ids so that shards from different runs agree on them.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NEWLINE = "\n"


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """A text tokenizer with the interface megatron-core's GPTDataset reads (`vocab_size`, `eod`, `pad`) and the
    method names of its MegatronTokenizerBase (`tokenize`, `detokenize`, `vocab`); not a subclass, so that the CLIs and
    preprocessing workers need not import megatron-core (seconds a process)."""

    def __init__(self, path: str, backend, *, eod: int, pad: Optional[int], bos: Optional[int], library: str,
                 model_sha256: str) -> None:
        self.path = path
        self.library = library
        self._backend = backend
        self._eod = eod
        self._pad = pad
        self._bos = bos
        self.model_sha256 = model_sha256

    # megatron-core's GPTDatasetConfig and MegatronDataset read these as attributes.
    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    @property
    def pad(self) -> int:
        if self._pad is None:
            raise AttributeError("this tokenizer defines no pad token")
        return self._pad

    @property
    def unique_identifiers(self) -> dict:
        """What megatron-core hashes into its dataset cache keys: the model, not where it lies."""
        return {"class": type(self).__name__, "library": self.library, "model_sha256": self.model_sha256,
                "vocab_size": self.vocab_size, "eod": self.eod}

    @property
    def vocab(self) -> dict[str, int]:
        return {self._backend.id_to_piece(i): i for i in range(self.vocab_size)}

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text)

    def encode_batch(self, texts: Sequence[str], append_eod: bool = False) -> list[list[int]]:
        """Encode on the calling thread only (preprocessing parallelises over processes); with `append_eod`, each
        document's ids end with the end-of-document token."""
        if append_eod:
            return self._backend.encode_batch(list(texts), append_id=self._eod)
        return self._backend.encode_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids])

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizers carry no chat template")

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, {self.library}, vocab_size={self.vocab_size}, eod={self.eod})"


def _unreadable(path: str, kind: str, err: Exception) -> ValueError:
    """A model file its library cannot parse (a RuntimeError or a bare Exception of a C++/Rust binding)."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ValueError(f"tokenizer {path} is not a readable {kind} ({detail}); give a tokenizer directory written by "
                      "`python -m data.tokenizer`, or the model file itself")


class _SentencePieceBackend:
    def __init__(self, model_path: str) -> None:
        import sentencepiece

        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except RuntimeError as err:
            raise _unreadable(model_path, "sentencepiece model", err) from None
        self.vocab_size = self.processor.vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def encode_batch(self, texts: list[str], append_id: Optional[int] = None) -> list[list[int]]:
        if append_id is not None and append_id == self.processor.eos_id():
            return self.processor.encode(texts, num_threads=1, add_eos=True)  # appended in C++, no list copies
        encoded = self.processor.encode(texts, num_threads=1)
        return encoded if append_id is None else [ids + [append_id] for ids in encoded]

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)

    def id_to_piece(self, i: int) -> str:
        return self.processor.id_to_piece(i)


class _HuggingFaceBackend:
    def __init__(self, tokenizer_json: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as err:
            raise ImportError(f"{tokenizer_json} is a Hugging Face tokenizer: pip install tokenizers to use it") from err
        try:
            self.tokenizer = HFTokenizer.from_file(tokenizer_json)
        except Exception as err:  # the Rust binding raises a bare Exception for a file it cannot parse
            raise _unreadable(tokenizer_json, "Hugging Face tokenizer.json", err) from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], append_id: Optional[int] = None) -> list[list[int]]:
        tail = [] if append_id is None else [append_id]
        return [e.ids + tail for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.tokenizer.id_to_token(i)


class _TiktokenBackend:
    ENDOFTEXT = "<|endoftext|>"
    # The split pattern of cl100k_base, the usual companion of a .tiktoken rank file.
    PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
               r"""\s+(?!\S)|\s+""")

    def __init__(self, rank_file: str) -> None:
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as err:
            raise ImportError(f"{rank_file} is a tiktoken BPE file: pip install tiktoken to use it") from err
        ranks = load_tiktoken_bpe(rank_file)
        self.encoding = tiktoken.Encoding(Path(rank_file).stem, pat_str=self.PATTERN, mergeable_ranks=ranks,
                                          special_tokens={self.ENDOFTEXT: len(ranks)})
        self.vocab_size = self.encoding.n_vocab
        self.eod = len(ranks)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str], append_id: Optional[int] = None) -> list[list[int]]:
        tail = [] if append_id is None else [append_id]
        return [ids + tail for ids in self.encoding.encode_ordinary_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def id_to_piece(self, i: int) -> str:
        return self.encoding.decode_single_token_bytes(i).decode("utf-8", errors="replace")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer directory written by `train`/`import`, a sentencepiece `.model`, a HF `tokenizer.json` (or a
    directory holding one) or a `.tiktoken` file."""
    path = str(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, MODEL_FILE)):
            return _load_sentencepiece(os.path.join(path, MODEL_FILE), _read_config(path))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return _load_huggingface(os.path.join(path, "tokenizer.json"))
        raise FileNotFoundError(
            f"tokenizer directory {path} holds neither {MODEL_FILE} nor tokenizer.json; "
            f"train one with `python -m data.tokenizer train --input FILES --vocab-size V --out {path}`"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    if path.endswith(".model"):
        return _load_sentencepiece(path, None)
    if path.endswith(".json"):
        return _load_huggingface(path)
    if path.endswith(".tiktoken"):
        backend = _TiktokenBackend(path)
        return Tokenizer(path, backend, eod=backend.eod, pad=None, bos=None, library="tiktoken",
                         model_sha256=file_sha256(path))
    raise ValueError(f"tokenizer {path}: expected a directory, a sentencepiece .model, a tokenizer.json or a .tiktoken")


def _read_config(directory: str) -> Optional[dict]:
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as stream:
        try:
            return json.load(stream)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path} is not JSON ({err}): the tokenizer directory is damaged; write it "
                             "again with `python -m data.tokenizer`") from None


def _load_sentencepiece(model_path: str, config: Optional[dict]) -> Tokenizer:
    backend = _SentencePieceBackend(model_path)
    processor = backend.processor
    eod = config["eod_id"] if config else processor.eos_id()
    if eod < 0:
        raise ValueError(f"sentencepiece model {model_path} has no end-of-sentence token to separate documents")
    pad = config.get("pad_id") if config else (processor.pad_id() if processor.pad_id() >= 0 else None)
    bos = processor.bos_id() if processor.bos_id() >= 0 else None
    return Tokenizer(os.path.dirname(model_path) if config else model_path, backend, eod=eod, pad=pad, bos=bos,
                     library="sentencepiece", model_sha256=file_sha256(model_path))


def _load_huggingface(tokenizer_json: str) -> Tokenizer:
    backend = _HuggingFaceBackend(tokenizer_json)
    eod = None
    for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
        eod = backend.tokenizer.token_to_id(name)
        if eod is not None:
            break
    if eod is None:
        raise ValueError(f"{tokenizer_json}: found no end-of-document token (<|endoftext|>, </s>, <eos>)")
    pad = backend.tokenizer.token_to_id("<pad>")
    return Tokenizer(tokenizer_json, backend, eod=eod, pad=pad, bos=None, library="huggingface",
                     model_sha256=file_sha256(tokenizer_json))


def sample_sentences(documents: Iterable[str], max_sentences: int, seed: int,
                     max_sentence_bytes: Optional[int] = None) -> tuple[list[str], int]:
    """A uniform sample of at most `max_sentences` non-empty lines (reservoir sampling), in corpus order, and the
    number of lines seen. Lines over `max_sentence_bytes` are passed over (sentencepiece would drop them), so memory
    stays below max_sentences x max_sentence_bytes whatever the corpus size."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    seen = 0
    for document in documents:
        for line in document.split(NEWLINE):
            if not line.strip():
                continue
            if max_sentence_bytes is not None and len(line) * 4 > max_sentence_bytes and \
                    len(line.encode("utf-8")) > max_sentence_bytes:
                continue
            if len(reservoir) < max_sentences:
                reservoir.append((seen, line))
            else:
                slot = rng.randint(0, seen)
                if slot < max_sentences:
                    reservoir[slot] = (seen, line)
            seen += 1
    reservoir.sort()
    return [line for _, line in reservoir], seen


# What sentencepiece's trainer raises when the corpus cannot fill the vocabulary, or its characters overflow it.
VOCABULARY_TOO_LARGE = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
VOCABULARY_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


@contextlib.contextmanager
def vocabulary_checked(vocab_size: int, model_type: str, character_coverage: float,
                       option: str = "--vocab-size") -> Iterator[None]:
    """Turn sentencepiece's refusal of a vocabulary size this corpus cannot support (a RuntimeError with a C++
    location) into a ValueError naming the asked size (set by ``option``) and the largest or smallest one the corpus
    supports."""
    try:
        yield
    except RuntimeError as err:
        too_large, too_small = VOCABULARY_TOO_LARGE.search(str(err)), VOCABULARY_TOO_SMALL.search(str(err))
        if too_large:
            raise ValueError(f"vocabulary size {vocab_size} is more than this corpus supports for a {model_type} "
                             f"tokenizer (at most {too_large.group(2)} pieces): give {option} "
                             f"{too_large.group(2)} or less, or more text") from None
        if too_small:
            raise ValueError(f"vocabulary size {vocab_size} is too small for the characters of this corpus (they "
                             f"need {too_small.group(2)} ids at character coverage {character_coverage}): give "
                             f"{option} {too_small.group(2)} or more, or a lower --character-coverage") from None
        raise


def _counted(items: Iterable[str], count: list) -> Iterator[str]:
    for item in items:
        count[0] += 1
        yield item


def train_tokenizer(
    files: Sequence[str],
    out_dir: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    byte_fallback: bool = True,
    special_tokens: Sequence[str] = (),
    max_sentences: int = 2_000_000,
    max_sentence_length: int = 16384,
    text_field: str = "text",
    txt_mode: str = "file",
    character_coverage: float = 0.9999,
    seed: int = 1234,
    num_threads: Optional[int] = None,
    progress: bool = False,
    vocab_option: str = "--vocab-size",
) -> Tokenizer:
    """Train a lossless sentencepiece model on `files` and write it to `out_dir` (atomically: a reader never sees a
    half-written directory). A vocabulary size the corpus cannot support is refused naming `vocab_option`, the
    setting the user gave it with."""
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type={model_type!r}: use 'bpe' or 'unigram'")
    if max_sentences < 1:
        raise ValueError(f"max_sentences={max_sentences} must be at least 1")
    if max_sentence_length < 1:
        raise ValueError(f"max_sentence_length={max_sentence_length} must be at least 1 (bytes a line)")
    if not 0.98 <= character_coverage <= 1:  # sentencepiece's own bounds
        raise ValueError(f"character_coverage={character_coverage} must lie in [0.98, 1]")
    reserved = 4 + 1 + len(special_tokens) + (256 if byte_fallback else 0)
    if vocab_size <= reserved:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for learned pieces beside the {reserved} reserved "
                         f"ids (special tokens, newline{', 256 bytes' if byte_fallback else ''}); use at least {reserved + 64}")
    documents: Iterator[str] = readers.iter_documents(files, text_field, txt_mode)
    if progress:
        from tqdm import tqdm

        documents = tqdm(documents, desc="reading documents", unit=" docs", file=sys.stderr)
    started = time.perf_counter()
    read = [0]
    sentences, seen = sample_sentences(_counted(documents, read), max_sentences, seed, max_sentence_length)
    if not sentences and read[0]:
        raise ValueError(f"the {read[0]} documents of {files[0] if len(files) == 1 else f'{len(files)} files'} have "
                         f"no line of at most max_sentence_length={max_sentence_length} bytes to train on; raise it")
    if not sentences:
        raise readers.empty_corpus(list(files), text_field)
    model = io.BytesIO()
    with vocabulary_checked(vocab_size, model_type, character_coverage, vocab_option):
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=[NEWLINE, *special_tokens],
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            max_sentence_length=max_sentence_length,
            input_sentence_size=0,  # the sample above already bounds the input
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    config = {
        "library": "sentencepiece",
        "model_type": model_type,
        "vocab_size": vocab_size,
        "eod_id": EOS_ID,
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "unk_id": UNK_ID,
        "byte_fallback": byte_fallback,
        "special_tokens": list(special_tokens),
        "trained_on": {"files": [os.path.abspath(f) for f in files], "sentences_seen": seen,
                       "sentences_sampled": len(sentences), "text_field": text_field},
        "model_sha256": hashlib.sha256(model.getvalue()).hexdigest(),
    }
    _write_tokenizer_dir(out_dir, model.getvalue(), config)
    if progress:
        print(f"trained {model_type} vocab {vocab_size} on {len(sentences)} of {seen} lines in "
              f"{time.perf_counter() - started:.1f} s -> {out_dir}", file=sys.stderr)
    return load_tokenizer(out_dir)


def import_sentencepiece(model_path: str | os.PathLike, out_dir: str | os.PathLike) -> Tokenizer:
    """Make a tokenizer directory from an existing sentencepiece model (its eos becomes the end-of-document token)."""
    import sentencepiece

    data = Path(model_path).read_bytes()
    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    except RuntimeError as err:
        raise _unreadable(str(model_path), "sentencepiece model", err) from None
    if processor.eos_id() < 0:
        raise ValueError(f"{model_path} has no eos token to use as the end-of-document token")
    config = {
        "library": "sentencepiece",
        "vocab_size": processor.vocab_size(),
        "eod_id": processor.eos_id(),
        "pad_id": processor.pad_id() if processor.pad_id() >= 0 else None,
        "bos_id": processor.bos_id() if processor.bos_id() >= 0 else None,
        "unk_id": processor.unk_id(),
        "imported_from": os.path.abspath(model_path),
        "model_sha256": hashlib.sha256(data).hexdigest(),
    }
    _write_tokenizer_dir(out_dir, data, config)
    return load_tokenizer(out_dir)


def _write_tokenizer_dir(out_dir: str | os.PathLike, model: bytes, config: dict) -> None:
    """``out_dir`` replaced atomically by the tokenizer (an earlier tokenizer written here replaced; anything else
    there moved aside, never deleted)."""
    staging = Path(staging_directory(str(out_dir)))
    try:
        (staging / MODEL_FILE).write_bytes(model)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        moved = replace_directory(staging, out_dir, WRITER)
        if moved:
            print(f"what {out_dir} held before is kept in {moved}", file=sys.stderr)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = ArgumentParser(prog="python -m data.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a sentencepiece tokenizer on corpus files")
    train.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="tokenizer directory to write: new, empty, or an earlier tokenizer")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    train.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                       help="encode characters outside the vocabulary as byte tokens (default: on)")
    train.add_argument("--special-tokens", nargs="*", default=[], help="user-defined tokens never split")
    train.add_argument("--max-sentences", type=int, default=2_000_000,
                       help="train on a uniform sample of at most this many lines (bounds memory)")
    train.add_argument("--max-sentence-length", type=int, default=16384, help="longer lines (bytes) are ignored")
    train.add_argument("--character-coverage", type=float, default=0.9999)
    train.add_argument("--preset", choices=sorted(readers.PRESETS), help="text field and file globs of a known corpus")
    train.add_argument("--text-field", default=None, help="JSON/parquet field holding the text (default: text)")
    train.add_argument("--txt-mode", choices=readers.TXT_MODES, default="file",
                       help=".txt inputs: one document per file or per blank-line block")
    train.add_argument("--seed", type=int, default=1234)
    imported = commands.add_parser("import", help="make a tokenizer directory from an existing sentencepiece model")
    imported.add_argument("--model", required=True)
    imported.add_argument("--out", required=True)
    for command in (train, imported):
        command.add_argument("--force", action="store_true",
                             help="write to an --out that holds other files: they are moved aside to OUT.old-<time>")
    args = parser.parse_args(argv)

    if args.command == "import":
        check_output(args.out, [args.model], WRITER, args.force)
        tokenizer = import_sentencepiece(args.model, args.out)
        print(f"imported {args.model} -> {args.out} (vocab {tokenizer.vocab_size}, eod {tokenizer.eod})")
        return
    preset = readers.PRESETS[args.preset] if args.preset else None
    text_field = args.text_field or (preset.text_field if preset else "text")
    files = readers.expand_inputs(args.input, preset.globs if preset else ())
    check_output(args.out, [path for path in args.input if os.path.isdir(path)] + files, WRITER, args.force)
    try:
        tokenizer = train_tokenizer(
            files, args.out, args.vocab_size, model_type=args.model_type, byte_fallback=args.byte_fallback,
            special_tokens=args.special_tokens, max_sentences=args.max_sentences,
            max_sentence_length=args.max_sentence_length, text_field=text_field, txt_mode=args.txt_mode,
            character_coverage=args.character_coverage, seed=args.seed, progress=True,
        )
    except readers.EmptyCorpus as err:
        raise readers.given_inputs(err, args.input, files) from None
    print(f"wrote {args.out}: vocab {tokenizer.vocab_size}, eod id {tokenizer.eod}")


if __name__ == "__main__":
    sys.exit(run(main))
