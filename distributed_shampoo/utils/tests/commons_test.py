from abc import ABC, abstractmethod

import pytest

from distributed_shampoo.utils.commons import batched, get_all_non_abstract_subclasses


@pytest.mark.parametrize(
    ("iterable", "n", "expected"),
    [
        (range(1, 7), 2, [(1, 2), (3, 4), (5, 6)]),
        (range(1, 6), 2, [(1, 2), (3, 4), (5,)]),
        ([], 3, []),
        ("abcd", 2, [("a", "b"), ("c", "d")]),
        ([1, 2, 3], 1, [(1,), (2,), (3,)]),
    ],
)
def test_batched(iterable: object, n: int, expected: list[tuple[object, ...]]) -> None:
    assert list(batched(iterable, n)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [-1, 0])
def test_batched_rejects_non_positive_n_on_first_iteration(n: int) -> None:
    generator = batched([1, 2], n)  # nothing raised yet: it is a generator
    with pytest.raises(ValueError, match=rf"n={n} must be at least one"):
        next(generator)


class _Root:
    pass


class _First(_Root):
    pass


class _Second(_First):
    pass


class _SecondRoot:
    pass


class _Mixed(_SecondRoot, _Second):
    pass


class _Abstract(_Mixed, ABC):
    @abstractmethod
    def __init__(self) -> None: ...


class _Leaf(_Abstract):
    def __init__(self) -> None:
        pass


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (_Root, {_Root, _First, _Second, _Mixed, _Leaf}),
        (_SecondRoot, {_SecondRoot, _Mixed, _Leaf}),
        (_Abstract, {_Leaf}),
        (_Leaf, {_Leaf}),
    ],
)
def test_get_all_non_abstract_subclasses(cls: type, expected: set[type]) -> None:
    found: list[type] = list(get_all_non_abstract_subclasses(cls))
    assert len(found) == len(set(found)), "each class must appear once"
    assert set(found) == expected
