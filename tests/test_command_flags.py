"""Every flag an error message tells a user to pass exists in the parser of the command that prints it: the flags
named in each entry point's refusals (its own, and NIAH's, which evaluate and analyze share under different length
flags) against the options its parser accepts."""

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.train_runs import REPO

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")
COMMANDS = ["diff_transformer.compare", "diff_transformer.evaluate", "diff_transformer.analyze",
            "diff_transformer.export", "diff_transformer.import_hf", "diff_transformer.checkpoint",
            "diff_transformer.quickstart", "data.inspect", "data.preprocess", "data.tokenizer", "launch.slurm"]
# Commands that pass another command's flags through (launch.slurm preprocess runs data.preprocess per array task).
FORWARDED = {"launch.slurm": "data.preprocess"}


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_flags(module_name, monkeypatch) -> set:
    """Every option string of the command's parser and its subcommands' (captured as main() parses)."""
    def capture(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(Captured) as caught:
        importlib.import_module(module_name).main(["x"])
    flags, parsers = set(), [caught.value.parser]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return flags


def refusal_flags(module_name) -> dict:
    """flag -> the message text of each raise or parser.error(...) in the module's source that names it."""
    path = REPO / Path(*module_name.split(".")).with_suffix(".py")
    named = {}
    for node in ast.walk(ast.parse(path.read_text())):
        is_error_call = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "error", "print_error")
        if not (isinstance(node, ast.Raise) or is_error_call):
            continue
        for part in ast.walk(node):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                for flag in FLAG.findall(part.value):
                    named.setdefault(flag, part.value)
    return named


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_a_refusal_names_is_a_flag_of_its_command(command, monkeypatch):
    accepted = parser_flags(command, monkeypatch) | {"--help"}
    if command in FORWARDED:
        accepted |= parser_flags(FORWARDED[command], monkeypatch)
    missing = {flag: text for flag, text in refusal_flags(command).items() if flag not in accepted}
    assert not missing, f"{command} tells users to pass flags its parser lacks: {missing}"


@pytest.mark.parametrize("command, length_flag", [("diff_transformer.evaluate", "--lengths"),
                                                  ("diff_transformer.analyze", "--length")])
def test_niah_refusals_name_the_length_flag_of_the_command(command, length_flag, monkeypatch):
    from diff_transformer.evaluation import niah

    accepted = parser_flags(command, monkeypatch)
    messages = []
    for config, limits in ((niah.NiahConfig(lengths=()), {}), (niah.NiahConfig(lengths=(512,)), {"max_length": 256}),
                           (niah.NiahConfig(lengths=(64,)), {"min_length": 100})):
        with pytest.raises(ValueError) as refused:
            config.validate(length_flag=length_flag, **limits)
        messages.append(str(refused.value))
    named = {flag for message in messages for flag in FLAG.findall(message)}
    assert length_flag in named and named <= accepted, (named - accepted, messages)
