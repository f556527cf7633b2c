"""Name -> class registries for the variant families (positional encodings, activations, norms, strategies,
tokenizers), and typed options for each variant.

A registered class declares what its config node may hold as a dataclass named ``Options`` (no ``Options``:
the variant takes no options besides ``name``). ``registry.build_options(name, values)`` turns the plain
values of a config node into that dataclass: an unknown key, or a value of the wrong type, is a
:class:`ConfigError` that names the key, the allowed keys or type, and the fix. Range checks that a type
cannot express belong in the dataclass's ``__post_init__``.

    @dataclass(frozen=True)
    class Options:
        base: float = 10000.0
        scaling: Literal["none", "linear"] = "none"
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, Union

from gptlab.errors import ConfigError

#: The Hydra config folder of a source checkout (an editable install): one folder per config group, one YAML
#: per choice of it, each registered variant's among them.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a variant that takes none."""


def import_plugins(modules: Sequence[str] | None, where: str = "plugins") -> None:
    """Import the user's modules that register variants outside gptlab (``plugins=[my_variants]``), so that
    their names are known before a config or a checkpoint that uses them is read. ``where`` says where the
    list came from, for the error."""
    for module in modules or []:
        try:
            _import_from_path_or_working_directory(str(module))
        except ImportError as e:
            raise ConfigError(
                f"{where}=[{module}] cannot be imported ({e}): put the module on PYTHONPATH (or install it), or "
                "remove it from plugins."
            ) from None


def _import_from_path_or_working_directory(module: str) -> None:
    """Import ``module``; one not found on ``sys.path`` is looked for in the working directory as well, as
    ``python -m`` would (``python scripts/generate.py`` puts scripts/ first, not the directory it is run in)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module.split(".")[0] or here in sys.path:
            raise
        sys.path.append(here)
        importlib.import_module(module)


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key  # the override a user types, e.g. "pos"
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            if isinstance(obj, type):
                obj.choice_name = name  # type: ignore[attr-defined]  # the name a config chooses it by
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f" Did you mean {self.config_key}={close[0]}?" if close else ""
            raise ConfigError(
                f"Unknown {self.kind} {name!r}. Choose one of: {', '.join(self.names())} "
                f"(for example `python train.py {self.config_key}={self.names()[0]}`).{hint}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def options_type(self, name: str) -> type:
        """The ``Options`` dataclass of variant ``name`` (:class:`NoOptions` when it declares none)."""
        return getattr(self.get(name), "Options", NoOptions)

    def build_options(self, name: str, values: Mapping[str, Any] | None = None) -> Any:
        """The typed options of variant ``name`` from a config node's plain values (its ``name`` key, the
        choice itself, is skipped)."""
        values = {k: v for k, v in (values or {}).items() if k != "name"}
        return build_options(self.options_type(name), values, f"{self.config_key}={name}", self.config_key)

    def choose(self, node: str | Mapping[str, Any] | Choice) -> Choice:
        """The variant a config node chooses, with its typed options: ``node`` is the name alone, the node
        (``{"name": "rope", "base": 500.0}``), or a Choice already made (returned as it is)."""
        if isinstance(node, Choice):
            if isinstance(node.options, self.options_type(node.name)):
                return node
            node = node.node()  # a bare Choice("rope"): its options are the defaults
        if isinstance(node, str):
            return Choice(node, self.build_options(node))
        if not isinstance(node, Mapping) or not isinstance(node.get("name"), str):
            raise ConfigError(
                f"{self.config_key}={node!r} must name a {self.kind} (one of {', '.join(self.names())}), "
                f"e.g. {self.config_key}={self.names()[0]}."
            )
        return Choice(node["name"], self.build_options(node["name"], node))


@dataclasses.dataclass(frozen=True)
class Choice:
    """A variant chosen by name, with its typed options (the variant's ``Options`` dataclass)."""

    name: str
    options: Any = NoOptions()

    def node(self) -> dict[str, Any]:
        """The config node that chooses it again: ``{"name": ..., **options}``."""
        return {"name": self.name, **dataclasses.asdict(self.options)}


def build_options(options_type: type, values: Mapping[str, Any], owner: str, prefix: str) -> Any:
    """``options_type(**values)`` after checking every key and the type of every value; ``owner`` names the
    choice in messages (``pos=rope``), ``prefix`` the config node (``pos``)."""
    fields = {f.name: f for f in dataclasses.fields(options_type) if f.init}
    check_keys(values, fields, owner, prefix)
    types_ = typing.get_type_hints(options_type)
    converted = {key: check_type(value, types_[key], _key(prefix, key)) for key, value in values.items()}
    return options_type(**converted)


def check_keys(
    values: Mapping[str, Any] | Sequence[str],
    allowed: Collection[str],
    owner: str,
    prefix: str,
    fix: str = "",
) -> None:
    """The one check of a config node's keys: every key of ``values`` must be in ``allowed``, or a
    ConfigError names the unknown keys, the allowed ones, the closest match, and the fix (by default: remove
    the key, or choose a ``prefix`` that takes it)."""
    unknown = sorted(set(values) - set(allowed))
    if not unknown:
        return
    # A long list (Lightning's Trainer takes about 50 arguments) is left to the fix, which says where it is.
    listed = ", ".join(_key(prefix, k) for k in allowed) if len(allowed) <= 40 else ""
    suggestions = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(allowed), n=1)
        suggestions.append(f" Did you mean {_key(prefix, close[0])}?" if close else "")
    fix = fix or (
        f"Remove the key from the command line or the YAML, or choose a {prefix} that takes it."
        if prefix and owner != prefix
        else "Remove the key from the command line or the YAML."
    )
    raise ConfigError(
        f"{owner} does not take option(s) {', '.join(_key(prefix, k) for k in unknown)}. "
        + (f"Its options: {listed or 'none'}. " if listed or not allowed else "")
        + f"{fix}{''.join(suggestions)}"
    )


def _key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def check_type(value: Any, hint: Any, label: str) -> Any:
    """``value`` converted to ``hint`` (an int where a float is wanted becomes a float), or a ConfigError.
    Understands the types options use: bool, int, float, str, None, unions of them and Literal choices."""
    ok, converted = _match(value, hint)
    if ok:
        return converted
    close = difflib.get_close_matches(str(value), _literal_names(hint), n=1) if isinstance(value, str) else []
    raise ConfigError(
        f"{label}={value!r} must be {_describe(hint)} (got {type(value).__name__})."
        + (f" Did you mean {label}={close[0]}?" if close else "")
    )


def _literal_names(hint: Any) -> list[str]:
    """The string choices a hint allows (``Literal["none", "yarn"]``, also inside a union), for a typo's
    closest one."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return [a for a in typing.get_args(hint) if isinstance(a, str)]
    if origin in (Union, types.UnionType):
        return [name for arg in typing.get_args(hint) for name in _literal_names(arg)]
    return []


def _match(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, converted = _match(value, arg)
            if ok:
                return True, converted
        return False, value
    if hint is Any:
        return True, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is float:
        # YAML and the command line write 2 for 2.0; a bool is not a number here.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a type these options do not use: left to the dataclass


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        names = typing.get_args(hint)
        return repr(names[0]) if len(names) == 1 else "one of " + ", ".join(repr(a) for a in names)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
