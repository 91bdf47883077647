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
