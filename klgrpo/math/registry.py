"""A tiny name -> object registry that refuses duplicates and lists the valid names on a miss.

Every extension point of the math (policy losses, KL estimators, shapings, aggregations, controllers) is one
registry, filled where the implementation is written::

    @POLICY_LOSSES.register("gspo")
    def gspo_surrogate(...): ...

The config offers the registered names as a field's choices, so the name is written once, above the code.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar, overload

T = TypeVar("T")


class Registry(Generic[T]):
    """Mapping from a config name to an implementation.

    Unknown names raise a ``KeyError`` whose message lists every valid name, so a typo in a config
    file is answered with the fix.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, item: T) -> T: ...

    def register(self, name, item=None):
        """Register ``item`` under ``name``; without ``item``, a decorator that registers what it decorates
        (and returns it unchanged)."""
        if item is None:
            return lambda decorated: self.register(name, decorated)
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {valid}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return list(self._items)

    def items(self):
        return self._items.items()
