import pytest

from distributed_shampoo.utils.dict_zip_iterator import DictZipIterator


def test_equal_lengths_yield_dicts_then_stop() -> None:
    iterator: DictZipIterator[object] = DictZipIterator({"a": [1, 2, 3], "b": "xyz", "c": [True, False, True]})
    assert list(iterator) == [
        {"a": 1, "b": "x", "c": True},
        {"a": 2, "b": "y", "c": False},
        {"a": 3, "b": "z", "c": True},
    ]
    with pytest.raises(StopIteration):
        next(iterator)


def test_unequal_lengths_name_exhausted_and_active_keys() -> None:
    iterator: DictZipIterator[object] = DictZipIterator({"a": [1, 2, 3], "b": ["x", "y", "z"], "c": [True, False]})
    assert next(iterator) == {"a": 1, "b": "x", "c": True}
    assert next(iterator) == {"a": 2, "b": "y", "c": False}
    with pytest.raises(ValueError) as error:
        next(iterator)
    message = str(error.value)
    assert "Iterators have different lengths" in message
    assert "Exhausted: ['c']" in message
    assert "Still active: ['a', 'b']" in message


def test_empty_iterators_stop_at_once() -> None:
    with pytest.raises(StopIteration):
        next(DictZipIterator[int]({"a": [], "b": []}))


def test_one_empty_iterator_among_non_empty_ones() -> None:
    with pytest.raises(ValueError, match=r"Exhausted: \['a'\], Still active: \['b'\]"):
        next(DictZipIterator({"a": [], "b": [1]}))


def test_single_element() -> None:
    assert list(DictZipIterator({"only": [7]})) == [{"only": 7}]


def test_empty_mapping_yields_empty_dicts_without_end() -> None:
    iterator: DictZipIterator[object] = DictZipIterator({})
    assert [next(iterator) for _ in range(3)] == [{}, {}, {}]
