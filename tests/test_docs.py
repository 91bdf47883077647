"""The README's recipe runs as written: every train.py line composes against the config schema, every
``python -m`` line names only flags its command accepts."""

import re
import shlex
from pathlib import Path

import pytest

from tests.test_command_flags import parser_flags

REPO = Path(__file__).resolve().parent.parent
RECIPE_HEADING = "## Compare DIFF with its baseline on your data"


def recipe_commands():
    text = (REPO / "README.md").read_text()
    section = text.split(RECIPE_HEADING, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.replace(".venv/bin/python ", "")) for line in block.splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_recipe_goes_from_text_to_figure():
    heads = [(c[0], c[1]) for c in recipe_commands()]
    assert heads == [("-m", "data.tokenizer"), ("-m", "data.preprocess"), ("-m", "data.inspect"),
                     ("train.py", "-m"), ("-m", "diff_transformer.compare")]


def test_the_recipe_sweep_takes_data_overrides():
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    sweep = next(c for c in recipe_commands() if c[0] == "train.py")
    overrides = [a for a in sweep[1:] if a != "-m"]
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose("config", overrides=overrides))
    assert (cfg.data.source, cfg.data.tokenizer_dir, cfg.data.blend) == ("shards", "tok/", ["shards/mytext"])
    assert cfg.name == "tiny-sweep" and cfg.logging.wandb.mode == "offline"


@pytest.mark.parametrize("index", range(5))
def test_every_recipe_flag_is_a_flag_of_its_command(index, monkeypatch):
    command = recipe_commands()[index]
    if command[0] != "-m":
        pytest.skip("train.py takes Hydra overrides (the test above)")
    flags = {a.split("=")[0] for a in command[2:] if a.startswith("--")}
    assert flags <= parser_flags(command[1], monkeypatch), command


# ------------------------------------------------------------------------------------------------------------------
# The README is a map of docs/: every link resolves, every page is on the map
# ------------------------------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def markdown_files():
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def links(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # https: and the like
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = [line.lstrip("#") for line in resolved.read_text().splitlines() if line.startswith("#")]
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{path.name}: {broken}"


def test_every_docs_page_is_on_the_readme_map():
    mapped = {(REPO / target).resolve() for target in links(REPO / "README.md")}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")}
    assert pages <= mapped, sorted(p.name for p in pages - mapped)


def test_the_readme_reads_in_five_minutes():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    # the two commands, first and exactly as CI runs them (.ci/run: the README's setup, then its test command)
    blocks = re.findall(r"```bash\n(.*?)```", "\n".join(lines), re.S)
    assert blocks[0].strip() == ('python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ".[dev]" && '
                                 ".venv/bin/python -m diff_transformer.quickstart")
    assert blocks[1].strip() == ".venv/bin/python -m pytest"
