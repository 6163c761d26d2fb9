"""Zip several iterables that are keyed by name, insisting that they all have the same length."""

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

V = TypeVar("V")


class DictZipIterator(Iterator[dict[str, V]]):
    """Iterate `{key: iterable}` in lock step, yielding `{key: next item}` dicts.

    Stops when every iterable is exhausted in the same round. If only some of them run out, raises
    `ValueError` naming the exhausted and the still-active keys, because silently truncating (as
    `zip` does) would hide a bookkeeping bug. An empty mapping yields `{}` forever.
    """

    def __init__(self, data: Mapping[str, Iterable[V]]) -> None:
        self._iterators: dict[str, Iterator[V]] = {key: iter(values) for key, values in data.items()}

    def __iter__(self) -> "DictZipIterator[V]":
        return self

    def __next__(self) -> dict[str, V]:
        items: dict[str, V] = {}
        exhausted: list[str] = []
        for key, iterator in self._iterators.items():
            try:
                items[key] = next(iterator)
            except StopIteration:
                exhausted.append(key)
        if not exhausted:
            return items
        if len(exhausted) == len(self._iterators):
            raise StopIteration
        still_active = [key for key in self._iterators if key in items]
        raise ValueError(f"Iterators have different lengths. Exhausted: {exhausted}, Still active: {still_active}")
