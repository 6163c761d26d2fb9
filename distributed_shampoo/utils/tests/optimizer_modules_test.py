import logging
from typing import Any

import pytest
import torch

from distributed_shampoo.utils.optimizer_modules import OptimizerModule


class _Module(OptimizerModule):
    def __init__(
        self,
        attribute: Any = None,
        list_of_values: Any = None,
        tuple_of_values: Any = None,
        dictionary_of_values: Any = None,
        other_module: Any = None,
    ) -> None:
        self.attribute = attribute
        self.list_of_values = list_of_values
        self.tuple_of_values = tuple_of_values
        self.dictionary_of_values = dictionary_of_values
        self.other_module = other_module


def _example() -> _Module:
    return _Module(
        attribute=torch.tensor(42.0),
        list_of_values=[OptimizerModule(), torch.tensor(1.0)],
        tuple_of_values=(1.0, 2.0, 3.0),
        dictionary_of_values={"tensor": torch.tensor(2.0)},
        other_module=_Module(attribute=42),
    )


def _assert_nested_equal(actual: object, expected: object) -> None:
    """Exact comparison of nested dicts whose leaves may be tensors (tensor leaves must match type too)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (actual, expected)
        for key, value in expected.items():
            _assert_nested_equal(actual[key], value)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), (actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (actual, expected)


def test_state_dict_with_non_tensors() -> None:
    _assert_nested_equal(
        _example().state_dict(store_non_tensors=True),
        {
            "attribute": torch.tensor(42.0),
            "list_of_values": {0: {}, 1: torch.tensor(1.0)},
            "tuple_of_values": {0: 1.0, 1: 2.0, 2: 3.0},
            "dictionary_of_values": {"tensor": torch.tensor(2.0)},
            "other_module": {
                "attribute": 42,
                "list_of_values": None,
                "tuple_of_values": None,
                "dictionary_of_values": None,
                "other_module": None,
            },
        },
    )


def test_state_dict_without_non_tensors_drops_empty_containers_but_keeps_modules() -> None:
    _assert_nested_equal(
        _example().state_dict(),
        {
            "attribute": torch.tensor(42.0),
            "list_of_values": {0: {}, 1: torch.tensor(1.0)},
            "dictionary_of_values": {"tensor": torch.tensor(2.0)},
            "other_module": {},
        },
    )


def test_state_dict_detaches_unless_keep_vars() -> None:
    module = _Module(attribute=torch.ones(2, requires_grad=True))
    assert not module.state_dict()["attribute"].requires_grad
    assert module.state_dict(keep_vars=True)["attribute"] is module.attribute


def test_state_dict_fills_given_destination() -> None:
    destination: dict[str, object] = {"existing": 1}
    returned = _Module(attribute=torch.tensor(3.0)).state_dict(destination=destination)
    assert returned is destination
    assert set(destination) == {"existing", "attribute"}


@pytest.mark.parametrize("store_non_tensors", [True, False])
def test_load_state_dict_round_trip_copies_in_place(store_non_tensors: bool) -> None:
    source = _Module(
        attribute=torch.tensor(24.0),
        list_of_values=[OptimizerModule(), torch.tensor(10.0)],
        tuple_of_values=(4.0, 5.0, 6.0),
        dictionary_of_values={"tensor": torch.tensor(20.0)},
        other_module=_Module(attribute=24),
    )
    target = _example()
    attribute_before = target.attribute
    target.load_state_dict(source.state_dict(store_non_tensors=store_non_tensors), store_non_tensors=store_non_tensors)

    assert target.attribute is attribute_before and target.attribute.item() == 24.0
    assert target.list_of_values[1].item() == 10.0
    assert target.dictionary_of_values["tensor"].item() == 20.0
    assert isinstance(target.tuple_of_values, tuple)
    assert target.tuple_of_values == ((4.0, 5.0, 6.0) if store_non_tensors else (1.0, 2.0, 3.0))
    assert target.other_module.attribute == (24 if store_non_tensors else 42)


def test_load_state_dict_keeps_values_of_non_matching_types(caplog: pytest.LogCaptureFixture) -> None:
    target = _example()
    with caplog.at_level(logging.WARNING):
        target.load_state_dict(
            {
                "attribute": 24,
                "list_of_values": {0: {}, 1: torch.tensor(10.0)},
                "tuple_of_values": {0: "hello", 1: 5.0, 2: 6.0},
                "dictionary_of_values": torch.tensor(4.0),
                "other_module": {"attribute": 24},
            },
            store_non_tensors=True,
        )
    assert torch.equal(target.attribute, torch.tensor(42.0))
    assert target.tuple_of_values == (1.0, 5.0, 6.0)
    assert torch.equal(target.dictionary_of_values["tensor"], torch.tensor(2.0))
    assert target.other_module.attribute == 24
    assert target.list_of_values[1].item() == 10.0
    messages = " | ".join(record.getMessage() for record in caplog.records)
    assert "must be tensors" in messages
    assert "Type mismatch" in messages
    assert "Expected a dict" in messages


def test_load_state_dict_converts_string_position_keys() -> None:
    target = _Module(list_of_values=[torch.tensor(1.0), torch.tensor(2.0)])
    target.load_state_dict({"list_of_values": {"0": torch.tensor(7.0), "1": torch.tensor(8.0)}})
    assert [value.item() for value in target.list_of_values] == [7.0, 8.0]


def test_load_state_dict_missing_position_raises_key_error_naming_it() -> None:
    target = _Module(list_of_values=[torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(KeyError, match=r"Position 1 .*available keys: \['0'\]"):
        target.load_state_dict({"list_of_values": {"0": torch.tensor(7.0)}})


def test_load_state_dict_empty_dict_for_non_empty_list_raises_key_error() -> None:
    target = _Module(list_of_values=[OptimizerModule(), torch.tensor(1.0)])
    with pytest.raises(KeyError, match="Position 0"):
        target.load_state_dict({"list_of_values": {}})


def test_load_state_dict_leaves_attributes_missing_from_the_state_dict() -> None:
    target = _example()
    target.load_state_dict({"attribute": torch.tensor(5.0)})
    assert target.attribute.item() == 5.0
    assert target.list_of_values[1].item() == 1.0
