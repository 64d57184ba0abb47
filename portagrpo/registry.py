"""Name-keyed registries: the trainer reaches every pluggable piece through one of these."""
from __future__ import annotations

import difflib
from typing import Generic, Iterator, TypeVar

from portagrpo.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, *names: str):
        def wrap(obj: T) -> T:
            for name in names:
                if name in self._items:
                    raise KeyError(f"{self.kind} {name!r} is registered twice")
                self._items[name] = obj
            return obj

        return wrap

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._items:
            where = f"{field}={name!r}" if field else f"{self.kind} {name!r}"
            close = difflib.get_close_matches(name, list(self._items), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(f"{where} is not a known {self.kind}{hint}; choose one of {', '.join(self._items)}.")
        return self._items[name]

    def set(self, name: str, obj: T) -> None:
        """Register or replace `name` (a plugin or a test standing in for a built-in)."""
        self._items[name] = obj

    @property
    def mapping(self) -> dict[str, T]:
        """The live name -> object table (for `monkeypatch.setitem` in tests)."""
        return self._items

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> list[str]:
        return list(self._items)
