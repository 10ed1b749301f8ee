"""Command-line flags derived from a config dataclass, as vLLM builds its CLI from its config classes.

Each field is one flag, --field-name: its type and default come from the field, its help text and options
from the field's metadata (`field(default=..., metadata=flag("what it does"))`). A setting is written once,
in its dataclass; compose and Kubernetes name it by env_name(field).
"""

from __future__ import annotations

import argparse
import enum
import types
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class FlagSpec:
    help: str = ""
    choices: tuple[str, ...] = ()
    exclusive: str = ""  # flags with the same name here are mutually exclusive
    group: str = ""  # the --help section the flag is listed under
    aliases: tuple[str, ...] = ()  # further option strings, e.g. "-tp"
    parse: Callable[[str], Any] | None = None  # the flag's text to the field's value, where the type alone cannot


def flag(help: str = "", *, choices: Sequence[str] = (), exclusive: str = "", group: str = "",
         aliases: Sequence[str] = (), parse: Callable[[str], Any] | None = None) -> dict[str, FlagSpec]:
    """A config field's flag metadata."""
    return {"flag": FlagSpec(help, tuple(choices), exclusive, group, tuple(aliases), parse)}


def env_name(field_name: str) -> str:
    """The environment variable compose.yaml and the Kubernetes manifests use for a flag: MAX_NUM_SEQS."""
    return field_name.upper()


def _unwrap(hint: Any) -> Any:
    """X for X | None, else the hint itself."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _argument(f: Field[Any], hint: Any, spec: FlagSpec) -> dict[str, Any]:
    kind, default = _unwrap(hint), _default(f)
    kw: dict[str, Any] = {"help": spec.help or None}
    if kind is bool:
        kw.update(action=argparse.BooleanOptionalAction if default else "store_true", default=default)
    elif get_origin(kind) is list:
        kw.update(action="append", type=get_args(kind)[0], default=None)
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        kw.update(choices=[e.value for e in kind], default=default.value)
    else:
        kw.update(type=spec.parse or kind, default=default)
        if spec.choices:
            kw["choices"] = list(spec.choices)
    return kw


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass cls (its base classes' fields first)."""
    hints = get_type_hints(cls)
    sections: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in fields(cls):
        spec = f.metadata.get("flag", FlagSpec())
        target: Any = parser
        if spec.group:
            if spec.group not in sections:
                sections[spec.group] = parser.add_argument_group(spec.group)
            target = sections[spec.group]
        if spec.exclusive:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = target.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        names = ["--" + f.name.replace("_", "-"), *spec.aliases]
        target.add_argument(*names, **_argument(f, hints[f.name], spec))


def config_from(cls: type[C], args: argparse.Namespace) -> C:
    """The dataclass cls from parsed flags: enum fields converted, an unused repeatable flag its default."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        value, kind = getattr(args, f.name), _unwrap(hints[f.name])
        if value is None and get_origin(kind) is list:
            value = _default(f)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum) and value is not None:
            value = kind(value)
        values[f.name] = value
    return cls(**values)
