import logging
from typing import Any

import pytest
import torch

from distributed_shampoo.utils.optimizer_modules import OptimizerModule
from distributed_shampoo.utils.shampoo_state_dict_utils import (
    extract_state_dict_content,
    update_param_state_dict_object,
)


class _Dummy(OptimizerModule):
    def __init__(self, field: torch.Tensor, tensor_list: list[torch.Tensor]) -> None:
        self._field = field
        self._thl = tensor_list


class _Pair(OptimizerModule):
    def __init__(self, a: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.a = a
        self.b = b


def test_extract_state_dict_content_converts_nested_modules() -> None:
    tensors = [torch.tensor(float(i)) for i in range(4)]
    extracted = extract_state_dict_content(
        {"inner_dict": {"foo": tensors[0], "bar": _Dummy(tensors[1], [tensors[2], tensors[3]])}}
    )
    assert extracted.keys() == {"inner_dict"}
    inner = extracted["inner_dict"]
    assert inner.keys() == {"foo", "bar"}
    assert inner["foo"] is tensors[0]
    assert inner["bar"].keys() == {"_field", "_thl"}
    assert torch.equal(inner["bar"]["_field"], tensors[1])
    assert inner["bar"]["_thl"].keys() == {0, 1}
    assert torch.equal(inner["bar"]["_thl"][0], tensors[2]) and torch.equal(inner["bar"]["_thl"][1], tensors[3])


def test_extract_state_dict_content_keeps_plain_values() -> None:
    step = torch.tensor(3)
    assert extract_state_dict_content({"step": step, "x": 5}) == {"step": step, "x": 5}


def test_update_param_state_dict_object_loads_in_place() -> None:
    a, c, m_a = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    module = _Pair(m_a, (torch.tensor(0.0), torch.tensor(0.0)))
    current: dict[str, Any] = {"a": a, "b": {"c": c}, "m": module, "o": [1]}
    to_load: dict[str, Any] = {
        "a": torch.tensor(10.0),
        "b": {"c": torch.tensor(20.0)},
        "m": {"a": torch.tensor(5.0), "b": {0: torch.tensor(6.0), 1: torch.tensor(7.0)}},
        "o": [2],
        "extra": 1,
    }
    update_param_state_dict_object(current, to_load)
    assert current["a"] is a and a.item() == 10.0
    assert current["b"]["c"] is c and c.item() == 20.0
    assert current["m"] is module and module.a is m_a and m_a.item() == 5.0
    assert [value.item() for value in module.b] == [6.0, 7.0]
    assert current["o"] == [2] and current["o"] is not to_load["o"]  # deep copied
    assert "extra" not in current


def test_update_param_state_dict_object_accepts_any_hashable_key() -> None:
    keys = ["123", 123, 0.1, True, None]
    current = {key: torch.tensor(0.0) for key in keys}
    update_param_state_dict_object(current, {key: torch.tensor(float(i)) for i, key in enumerate(keys)})
    assert [current[key].item() for key in keys] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_update_param_state_dict_object_missing_key_raises() -> None:
    with pytest.raises(KeyError, match="Key bar not found in state dict to load"):
        update_param_state_dict_object({"foo": torch.tensor(1.0), "bar": torch.tensor(2.0)}, {"foo": torch.tensor(3.0)})


def test_update_param_state_dict_object_missing_key_warns_when_check_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    current = {"foo": torch.tensor(1.0), "bar": torch.tensor(2.0)}
    with caplog.at_level(logging.WARNING):
        update_param_state_dict_object(current, {"foo": torch.tensor(3.0)}, enable_missing_key_check=False)
    assert current["foo"].item() == 3.0
    assert current["bar"].item() == 2.0
    assert ["Key bar not found" in record.getMessage() for record in caplog.records] == [True]
