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
    assert cfg.name == "tiny-wsd" and cfg.optim.decay == "wsd" and cfg.logging.wandb.mode == "offline"


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


# ------------------------------------------------------------------------------------------------------------------
# Every page reads in one shape (issue 44's measure: tests/readability.py)
# ------------------------------------------------------------------------------------------------------------------
MEAN_WORDS_MAX, LONGEST_SENTENCE_MAX, COMMAND_FIRST_SHARE = 18, 60, 0.8


def test_the_docs_read_in_short_sentences_with_the_command_first():
    from tests import readability

    measured = [readability.measure_page(p) for p in readability.pages(REPO)]
    mean, longest, share = readability.summary(measured)
    long_pages = {p.path.name: max(p.sentence_words) for p in measured if max(p.sentence_words or [0]) > LONGEST_SENTENCE_MAX}
    assert mean <= MEAN_WORDS_MAX, f"{mean:.1f} words a sentence; run python tests/readability.py 18 60 0.8"
    assert longest <= LONGEST_SENTENCE_MAX, long_pages
    assert share >= COMMAND_FIRST_SHARE, sorted(p.path.name for p in measured if not p.command_first)


def test_the_readability_measure_counts_prose_only():
    from tests import readability

    # headings, code blocks and tables are left out; inline code is one word; a bullet marker is a word; a
    # parenthesis of 200 characters or more is one word
    text = ("# A heading of many words that are not counted at all\n\n```bash\npython -m a.b --c d e f g h\n```\n\n"
            "| a table | of words | not counted either |\n\nOne two three four. `a long inline code span` counts once:\n"
            "* Five six seven.\n\nEight nine (" + "x " * 120 + ") ten.\n")
    assert [len(s.split()) for s in readability.sentences(text)] == [4, 3, 4, 4]


# ------------------------------------------------------------------------------------------------------------------
# Every documented command, flag and key exists
# ------------------------------------------------------------------------------------------------------------------
PROJECT_PACKAGES = ("diff_transformer", "data", "launch", "kernels", "benchmarks")
LAUNCHERS = ("python", "python3", ".venv/bin/python", "torchrun", "bash")
FILE_SUFFIXES = ("pt", "safetensors", "json", "jsonl", "py", "md", "bin", "idx", "yaml", "png")


def documented_commands():
    """(page, words) of every command line in the ```bash blocks of the README and docs/ (continuations joined,
    comments dropped, `a && b` split)."""
    commands = []
    for path in markdown_files():
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words, command = shlex.split(line, comments=True) + ["&&"], []
                for word in words:
                    if word != "&&":
                        command.append(word)
                    elif command:
                        commands.append((path.name, command))
                        command = []
    return commands


def invocation(words):
    """("module" | "script", its name, its arguments) of a command line, or None for a third-party tool."""
    words = [w for w in words if not re.match(r"[A-Z_]+=", w)]  # environment assignments
    if words and (words[0] in LAUNCHERS or words[0].endswith("/python")):
        words = [w for w in words[1:] if not w.startswith("--nproc")]  # torchrun's own
        if words[:1] == ["-m"]:
            return "module", words[1], words[2:]
    if words and words[0].endswith((".py", ".sh")):
        return "script", words[0], words[1:]
    return None


def test_documented_commands_are_found():
    found = [invocation(words) for _, words in documented_commands()]
    names = {f[1] for f in found if f}
    assert {"train.py", "data.preprocess", "diff_transformer.evaluate", "benchmarks/train_throughput.py",
            "launch.slurm", "benchmarks/gpu_run.sh"} <= names, names
    assert sum(f is not None for f in found) >= 100


@pytest.mark.parametrize("page", [p.name for p in markdown_files()])
def test_every_documented_command_and_flag_exists(page, monkeypatch):
    """A module runs with -m, a script is in the repository, and every --flag given to a project command is one of
    its parser's (the command's own parser where main() builds one, else the flag is spelled in its source)."""
    import importlib.util

    from tests.test_command_flags import COMMANDS, FORWARDED

    wrong = []
    for _, words in (c for c in documented_commands() if c[0] == page):
        found = invocation(words)
        if found is None:
            continue
        kind, name, args = found
        flags = {a.strip("[]|").split("=")[0] for a in args if a.strip("[]|").startswith("--")}
        if kind == "module":
            if importlib.util.find_spec(name) is None:
                wrong.append(f"no module {name}")
                continue
            if name.split(".")[0] not in PROJECT_PACKAGES:
                continue
            if name in COMMANDS:
                accepted = parser_flags(name, monkeypatch) | {"--help"}
                accepted |= parser_flags(FORWARDED[name], monkeypatch) if name in FORWARDED else set()
                missing = flags - accepted
            else:
                missing = {f for f in flags if f not in (REPO / (name.replace(".", "/") + ".py")).read_text()}
        elif name == "train.py" or not (REPO / name).exists():
            missing = set() if (REPO / name).exists() else {f"no file {name}"}
        else:
            missing = {f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", (REPO / name).read_text())}
        wrong += [f"{name} {m}" for m in sorted(missing)]
    assert not wrong, f"{page}: {wrong}"


def test_every_documented_override_composes():
    """Every train.py (and quickstart) line of the docs composes against the config schema: its keys exist, its
    values have their types (each value of a sweep's list). hydra.* settings and <placeholders> aside. One composition per set of group choices
    (experiment=, model=, ...); each line's key=value overrides are applied to it as Hydra applies them."""
    import copy

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from diff_transformer.config import register_configs, to_object

    by_choices = {}
    for page, words in documented_commands():
        found = invocation(words)
        if found and found[1] in ("train.py", "diff_transformer.quickstart"):
            overrides = [re.sub(r"<[^>]*>", "X", a) for a in found[2]
                         if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
            choices = tuple(o for o in overrides if (REPO / "configs" / o.split("=")[0].lstrip("+").split("@")[0]).is_dir())
            by_choices.setdefault(choices, []).append((page, [o for o in overrides if o not in choices]))
    register_configs()
    parser, failed, checked = OverridesParser.create(), [], 0
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for choices, lines in by_choices.items():
            base = compose("config", overrides=list(choices))
            for page, overrides in lines:
                cfg = copy.deepcopy(base)
                try:
                    for override in parser.parse_overrides(overrides):
                        # a multirun's list (seed=1,2,3) composes value by value
                        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
                        for value in values:
                            OmegaConf.update(cfg, override.key_or_group, value, merge=True)
                            to_object(cfg)
                    to_object(cfg)
                    checked += 1
                except Exception as error:  # noqa: BLE001 - every failure is a finding, reported with its page
                    failed.append(f"{page}: {list(choices) + overrides}: {type(error).__name__}: "
                                  f"{str(error).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    assert checked >= 40, checked


def schema_has(dotted):
    import dataclasses
    import typing

    from diff_transformer.config import Config

    node = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node):
            return True  # a Dict field (engine.extra): free-form below it
        if part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = typing.get_type_hints(node)[part]
    return True


def test_every_key_the_docs_name_is_a_config_key():
    """Inline `group.key` and `group.key=value` in the prose and tables name config keys; a dotted name that is a
    module of the repository (data.inspect, data.datasets.prepare) or a file (model.safetensors) is not a key."""
    import dataclasses

    from diff_transformer.config import Config

    key = re.compile(r"(%s)((?:\.[a-z0-9_]+)+)(=.*)?$" % "|".join(f.name for f in dataclasses.fields(Config)))
    unknown, checked = [], 0
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            match = key.fullmatch(span.strip())
            if not match:
                continue
            dotted = match.group(1) + match.group(2)
            parts = dotted.split(".")
            is_module = any((REPO / Path(*parts[:i])).with_suffix(".py").exists() for i in range(1, len(parts) + 1))
            if is_module or parts[-1] in FILE_SUFFIXES:
                continue
            checked += 1
            if not schema_has(dotted):
                unknown.append(f"{path.name}: {span}")
    assert not unknown, unknown
    assert checked >= 200, checked
