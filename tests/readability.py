"""Readability of the docs pages and the README: words per sentence (prose only: code blocks, tables, headings and
blank lines left out; inline code counts as one word), the longest sentence, and whether a page shows a command (a
fenced code block) within its first 25 lines. The measure of issue 44; tests/test_docs.py holds the docs to its bar.

    python tests/readability.py 18 60 0.8      # from the repository root: one line per page, a summary; exit 0 if it holds
"""
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
HEAD_LINES = 25  # a page's command must show within these


@dataclass
class Page:
    path: Path
    lines: int
    sentence_words: List[int]
    command_first: bool

    @property
    def mean(self) -> float:
        return sum(self.sentence_words) / max(1, len(self.sentence_words))


def prose(text: str) -> str:
    """The page's prose: a paragraph's lines joined, a newline where a block (code, table, heading, blank) was."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith(("|", "#")) or not line.strip():
            out.append("\n")
            continue
        out.append(line.strip())
    return " ".join(out)


def sentences(text: str) -> List[str]:
    body = re.sub(r"`[^`]*`", "X", prose(text))  # inline code counts as one word
    body = re.sub(r"\([^)]*\)", lambda m: m.group(0) if len(m.group(0)) < 200 else "(…)", body)
    return [s for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z`*\[])|\n", body) if len(s.split()) >= 3]


def measure_page(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    head = "\n".join(text.splitlines()[:HEAD_LINES])
    return Page(path, len(text.splitlines()), [len(s.split()) for s in sentences(text)], "```" in head)


def pages(root: Path = REPO) -> List[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def summary(measured: List[Page]):
    """(mean words a sentence over every page's sentences, the longest sentence, the share of command-first pages)."""
    words = [n for page in measured for n in page.sentence_words]
    return (sum(words) / max(1, len(words)), max(words or [0]),
            sum(page.command_first for page in measured) / len(measured))


def main(argv=None) -> int:
    mean_max, longest_max, command_share = (float(a) for a in (argv or sys.argv[1:]))
    measured = [measure_page(p) for p in pages()]
    for page in measured:
        print(f"{page.path.relative_to(REPO)}: {page.lines} lines, {page.mean:.1f} words/sentence, longest "
              f"{max(page.sentence_words or [0])}, command in first {HEAD_LINES} lines: {page.command_first}")
    mean, longest, share = summary(measured)
    print(f"docs + README: {mean:.1f} words/sentence (bar <= {mean_max}), longest sentence {longest} words "
          f"(bar <= {longest_max:.0f}), pages with a command in their first {HEAD_LINES} lines {share:.0%} "
          f"(bar >= {command_share:.0%})")
    return 0 if mean <= mean_max and longest <= longest_max and share >= command_share else 1


if __name__ == "__main__":
    sys.exit(main())
