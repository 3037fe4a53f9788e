"""Every command-line option explains itself: a help line, its default shown by ``--help``, choices listed."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import pytest

import experiments
from radixkv import serve

# shared code, not commands
LIBRARIES = ("agentic_engine", "agentic_replay", "agentic_sim", "agentic_tables", "common", "gpu_floors", "plots",
             "serve_client", "serve_load")


class _Parsed(Exception):
    """Raised instead of parsing: carries the parser a command built."""


def commands() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(experiments.__path__) if m.name not in LIBRARIES]


def parsers_of(main, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers ``main`` builds with help (pre-parsers without ``-h`` are internal), captured at parse time."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed):
        main([])
    return [p for p in seen if p.add_help]


def undocumented(p: argparse.ArgumentParser) -> list[str]:
    """The options of ``p`` whose ``--help`` line lacks a help text or the default."""
    bad = []
    text = p.format_help()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            bad.append(f"{name}: no help")
        elif action.option_strings and "%(default)" not in action.help and not issubclass(
                p.formatter_class, argparse.ArgumentDefaultsHelpFormatter):
            bad.append(f"{name}: default not shown")
        elif action.choices is not None and not all(str(c) in text for c in action.choices):
            bad.append(f"{name}: choices not listed")
    return bad


@pytest.mark.parametrize("name", commands())
def test_every_experiment_option_has_help_and_shows_its_default(name, monkeypatch):
    module = importlib.import_module(f"experiments.{name}")
    parsers = parsers_of(module.main, monkeypatch)
    assert parsers, f"experiments.{name}.main built no parser"
    for p in parsers:
        assert undocumented(p) == [], name


def test_every_serve_option_has_help_and_shows_its_default():
    p = serve.parser()
    assert undocumented(p) == []
    text = " ".join(p.format_help().split())
    assert "--dtype {auto,float32,bfloat16,float16}" in text and "(default: auto)" in text
    for action in p._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert "(default:" in " ".join(p._get_formatter()._expand_help(action).split()), action.option_strings
