"""A tiny name -> object registry that refuses duplicates and lists the valid names on a miss.

Every extension point of the math (policy losses, KL estimators, shapings, aggregations, controllers) is one
registry, filled where the implementation is written::

    @POLICY_LOSSES.register("gspo")
    def gspo_surrogate(...): ...

The config offers the registered names as a field's choices, so the name is written once, above the code. An
entry may declare its own settings at registration (``register("sapo", params=SapoParams)``): a frozen dataclass
whose fields are declared with :func:`param` (default, help, bounds), which the config reads and checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, TypeVar, overload

T = TypeVar("T")


def param(default: Any, help: str, *, low: float | None = None, above: bool = False, high: float | None = None,
          below: bool = False, at_low: str = "") -> Any:
    """A field of an entry's settings dataclass: its default, its one-line help and its bounds, under the metadata
    keys a config field's declaration uses (klgrpo/config/fields.py:setting), so the same check reads both."""
    meta = {"help": help, "low": low, "above": above, "high": high, "below": below, "at_low": at_low}
    return dataclasses.field(default=default, metadata=meta)


class Registry(Generic[T]):
    """Mapping from a config name to an implementation.

    Unknown names raise a ``KeyError`` whose message lists every valid name, so a typo in a config
    file is answered with the fix.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._params: dict[str, type] = {}

    @overload
    def register(self, name: str, *, params: type | None = None) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, item: T, *, params: type | None = None) -> T: ...

    def register(self, name, item=None, *, params=None):
        """Register ``item`` under ``name``; without ``item``, a decorator that registers what it decorates
        (and returns it unchanged). ``params``: the frozen dataclass of the entry's own settings, handed to it as
        keywords (None: it has none)."""
        if item is None:
            return lambda decorated: self.register(name, decorated, params=params)
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if params is not None and not (dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen):
            raise TypeError(f"{self.kind} {name!r}: params must be a frozen dataclass, got {params!r}")
        self._items[name] = item
        if params is not None:
            self._params[name] = params
        return item

    def params(self, name: str) -> type | None:
        """The settings dataclass ``name`` declared at registration (None: it has no settings of its own)."""
        self[name]  # an unknown name is refused with the valid ones
        return self._params.get(name)

    def unregister(self, name: str) -> None:
        """Remove ``name`` and its settings (tests that register an entry for a while)."""
        self._items.pop(name)
        self._params.pop(name, None)

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
