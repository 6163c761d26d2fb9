"""Small iteration helpers shared by the package."""

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import TypeVar

T = TypeVar("T")


def batched(iterable: Iterable[T], n: int) -> Iterator[tuple[T, ...]]:
    """Yield consecutive tuples of `n` items from `iterable`; the last tuple may be shorter.

    Behaves like Python 3.12's `itertools.batched`. Being a generator, it checks `n` when iteration
    starts, not when it is called.
    """
    if n < 1:
        raise ValueError(f"{n=} must be at least one.")
    iterator = iter(iterable)
    while batch := tuple(islice(iterator, n)):
        yield batch


def get_all_non_abstract_subclasses(cls: type[T]) -> Iterator[type[T]]:
    """Yield `cls` and all its transitive subclasses that have no abstract methods left.

    Each class appears once even when it is reachable through several bases (diamonds).
    """

    def walk(current: type[T]) -> Iterator[type[T]]:
        yield current
        for subclass in current.__subclasses__():
            yield from walk(subclass)

    for candidate in dict.fromkeys(walk(cls)):
        if not getattr(candidate, "__abstractmethods__", None):
            yield candidate
