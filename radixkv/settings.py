"""Settings that describe themselves: a config field carries its help text, its other keyword spellings
(aliases) and its other flag spellings, so flags and aliases are generated from the one definition.

``setting(default, help, aliases=..., flags=..., choices=...)`` declares a field of a config dataclass
(``StackConfig``, ``EngineConfig``). ``canonical(cls, settings)`` turns the keywords a caller gave into the
fields' own names. ``add_flags(parser, cls, ...)`` adds one flag per field, with its help and default, so a
new field is a new flag with no other edit; ``SettingsParser`` is an ``ArgumentParser`` whose parsed
namespace answers an alias as its field (``args.kv_cache_tokens`` is ``args.capacity_tokens``).

Torch-free; O(fields) per call.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, Field, field, fields
from typing import Any

from radixkv.checks import is_int, is_real


def setting(default: Any, help: str, *, aliases: tuple[str, ...] = (), flags: tuple[str, ...] = (),
            choices: Sequence[str] | None = None, minimum: int | None = None) -> Any:
    """A dataclass field with what its flag, its keyword aliases and its check need. ``flags`` are extra
    spellings of the flag (vLLM's, SGLang's), after ``--name``; ``aliases`` extra keyword names; ``choices``
    the values it takes (names); ``minimum`` the least number it takes (``problems`` checks its type from the
    annotation, then these). A dict default is copied per instance."""
    meta = {"help": help, "aliases": tuple(aliases), "flags": tuple(flags), "choices": choices, "minimum": minimum}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def described(cls: type) -> list[Field]:
    """The fields of ``cls`` declared with ``setting``."""
    return [f for f in fields(cls) if "help" in f.metadata]


def aliases(*classes: type) -> dict[str, str]:
    """Every alias of the classes' settings -> its field's name."""
    return {a: f.name for cls in classes for f in described(cls) for a in f.metadata["aliases"]}


def canonical(cls: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each alias replaced by its field's name; ``ValueError`` for a name that is neither a
    field of ``cls`` nor an alias, or a field given twice (by its name and an alias)."""
    names = {f.name for f in fields(cls)}
    spelled = aliases(cls)
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = spelled.get(key, key)
        if name not in names:
            raise ValueError(f"unknown setting {key!r}; the settings are {sorted(names)} "
                             f"(and the aliases {sorted(spelled)})")
        if name in out:
            raise ValueError(f"setting {name!r} given twice (as {name!r} and its alias)")
        out[name] = value
    return out


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def optional_int(text: str) -> int | None:
    """A flag's integer, or None spelled ``none`` (the default size; no tier)."""
    return None if text.lower() == "none" else int(text)


# A setting's annotation (a string here) -> its type test, the type's name, and what ``add_argument`` needs.
KINDS: dict[str, tuple[Callable[[Any], bool], str, dict[str, Any]]] = {
    "int": (is_int, "an integer", {"type": int}), "int|None": (is_int, "an integer", {"type": optional_int}),
    "float": (is_real, "a finite number", {"type": float}),
    "str": (lambda v: isinstance(v, str), "a string", {"type": str}),
    "bool": (lambda v: isinstance(v, bool), "a bool", {"action": argparse.BooleanOptionalAction}),
    "Mapping[str,Any]": (lambda v: isinstance(v, Mapping), "a mapping", {"type": json.loads}),
}


def _kind(f: Field) -> tuple[str, tuple[Callable[[Any], bool], str, dict[str, Any]]]:
    """The field's annotation and its ``KINDS`` entry; ``TypeError`` for a type settings cannot take."""
    kind = str(f.type).replace(" ", "")
    if kind not in KINDS:
        raise TypeError(f"setting {f.name!r}: no check or flag for type {kind}")
    return kind, KINDS[kind]


def problems(config: Any) -> list[str]:
    """What breaks each setting's own declaration in ``config``: its type (from its annotation; ``int | None``
    takes None, as one of the token budgets or tier sizes), then its ``choices`` or ``minimum``. O(fields)."""
    out = []
    for f in described(type(config)):
        (kind, (test, what, _)), value, meta = _kind(f), getattr(config, f.name), f.metadata
        if value is None and kind.endswith("|None"):
            continue
        bound = "" if meta["minimum"] is None else f" >= {meta['minimum']}"
        what += bound + (" or None (one of the token budgets or tier sizes)" if kind.endswith("|None") else "")
        if not test(value) or (bound and value < meta["minimum"]):
            out.append(f"{f.name} must be {what}, got {value!r}")
        elif meta["choices"] is not None and value not in meta["choices"]:
            out.append(f"{f.name} must be one of {list(meta['choices'])}, got {value!r}")
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Collection[str] | None = None, *,
              skip: Collection[str] = (), defaults: Mapping[str, Any] | None = None,
              helps: Mapping[str, str] | None = None, choices: Mapping[str, Sequence[str]] | None = None) -> None:
    """One flag per setting of ``cls`` (those of ``names`` if given, less ``skip``), in field order: its
    spellings (``--name``, then ``flags``), its type, choices, help and default (``defaults`` overrides the
    field's, ``helps`` its help, ``choices`` its choices for this command); the parsed value lands on the
    field's name."""
    defaults, helps, choices = defaults or {}, helps or {}, choices or {}
    for f in described(cls):
        if (names is not None and f.name not in names) or f.name in skip:
            continue
        options = dict(_kind(f)[1][2], dest=f.name, default=defaults.get(f.name, default_of(f)),
                       help=helps.get(f.name, f.metadata["help"]))
        if (chosen := choices.get(f.name, f.metadata["choices"])) is not None:
            options["choices"] = list(chosen)
        parser.add_argument(*dict.fromkeys(["--" + f.name.replace("_", "-"), *f.metadata["flags"]]), **options)


class SettingsNamespace(argparse.Namespace):
    """A parsed namespace that answers an alias of a setting as the setting itself."""

    ALIASES: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        target = type(self).ALIASES.get(name)
        if target is None or target not in vars(self):
            raise AttributeError(name)
        return getattr(self, target)


class SettingsParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose namespace reads the aliases of ``classes``' settings (see the module)."""

    def __init__(self, *args: Any, classes: Sequence[type] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespace_type = type("Settings", (SettingsNamespace,), {"ALIASES": aliases(*classes)})

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001 - argparse's own signature
        return super().parse_known_args(args, self.namespace_type() if namespace is None else namespace)
