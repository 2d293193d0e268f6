"""One name -> implementation table, for each choice a user types (backend=..., norm=...)."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations by name; `kind` names the choice in messages ("depthwise backend", "norm")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}") from None
