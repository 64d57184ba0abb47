"""Name-keyed registries: the trainer reaches every pluggable piece through one of these."""
from __future__ import annotations

import difflib
import importlib
from typing import Generic, Iterator, TypeVar

from portagrpo.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._modules: dict[str, str] = {}  # names whose module registers them when first asked for

    def register_module(self, name: str, module: str) -> None:
        """`name` is registered by importing `module`, done only when `name` is asked for (an optional
        dependency such as vLLM is imported only by the run that uses it)."""
        self._modules[name] = module

    def register(self, *names: str):
        def wrap(obj: T) -> T:
            for name in names:
                if name in self._items:
                    raise KeyError(f"{self.kind} {name!r} is registered twice")
                self._items[name] = obj
            return obj

        return wrap

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._items and name in self._modules:
            importlib.import_module(self._modules[name])
        if name not in self._items:
            where = f"{field}={name!r}" if field else f"{self.kind} {name!r}"
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(
                f"{where} is not a known {self.kind}{hint}; choose one of {', '.join(self.names())}."
            )
        return self._items[name]

    def set(self, name: str, obj: T) -> None:
        """Register or replace `name` (a plugin or a test standing in for a built-in)."""
        self._items[name] = obj

    @property
    def mapping(self) -> dict[str, T]:
        """The live name -> object table (for `monkeypatch.setitem` in tests)."""
        return self._items

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        return list(self._items) + [n for n in self._modules if n not in self._items]
