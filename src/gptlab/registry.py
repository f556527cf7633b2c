"""Name -> class registries for the variant families (positional encodings, activations, norms)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from gptlab.errors import ConfigError

T = TypeVar("T")


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
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            import difflib

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
