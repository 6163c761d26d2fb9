import logging

import pytest
import torch

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.utils.shampoo_quantization import (
    _FLOAT_DTYPES,
    DequantizeQuantizedTensorListContext,
    QuantizedTensor,
    QuantizedTensorList,
)

SOURCE = (1.0, 2.5, 1 / 3)


def _block_info() -> BlockInfo:
    return BlockInfo(param=torch.zeros(3), composable_block_ids=(0, "block_0"))


def _fp16_tensor() -> QuantizedTensor:
    return QuantizedTensor.init_from_dequantized_tensor(
        torch.tensor(SOURCE, dtype=torch.float64), torch.float16, _block_info()
    )


def test_init_from_dequantized_tensor_rounds_to_storage_dtype() -> None:
    quantized = _fp16_tensor()
    assert quantized.quantized_values.dtype == torch.float16
    torch.testing.assert_close(quantized.quantized_values, torch.tensor(SOURCE, dtype=torch.float16))
    assert quantized.quantized_values[2].item() == 0.333251953125
    assert quantized.min_value is None and quantized.max_value is None


def test_dequantize_same_dtype_returns_stored_tensor() -> None:
    quantized = _fp16_tensor()
    assert quantized.dequantize(torch.float16) is quantized.quantized_values


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES)
def test_dequantize_then_requantize(dtype: torch.dtype) -> None:
    quantized = _fp16_tensor()
    dequantized = quantized.dequantize(dtype)
    assert dequantized.dtype == dtype
    torch.testing.assert_close(dequantized, torch.tensor(SOURCE, dtype=torch.float16).to(dtype))
    quantized.quantize(dequantized + 1.0)
    # Expected: the update computed in `dtype`, then rounded to the fp16 storage.
    expected = (torch.tensor(SOURCE, dtype=torch.float16).to(dtype) + 1.0).to(torch.float16)
    torch.testing.assert_close(quantized.quantized_values, expected)
    assert quantized.quantized_values.dtype == torch.float16


def test_dequantize_example_values() -> None:
    assert _fp16_tensor().dequantize(torch.float64).tolist() == [1.0, 2.5, 0.333251953125]
    quantized = _fp16_tensor()
    quantized.quantize(torch.tensor([4.0, 5.0, 6.0], dtype=torch.float64))
    assert quantized.quantized_values.dtype == torch.float16
    assert quantized.quantized_values.tolist() == [4.0, 5.0, 6.0]


def test_integer_storage_is_not_supported() -> None:
    with pytest.raises(NotImplementedError, match=r"torch\.int64 is not yet supported"):
        QuantizedTensor.init_from_dequantized_tensor(torch.tensor(SOURCE), torch.int64, _block_info())
    integer = QuantizedTensor(torch.zeros(3, dtype=torch.int64), _block_info())
    assert integer.min_value is not None and integer.max_value is not None
    assert torch.equal(integer.min_value, torch.zeros(1)) and torch.equal(integer.max_value, torch.zeros(1))
    with pytest.raises(NotImplementedError, match="not yet supported"):
        integer.dequantize(torch.float32)


def test_float_storage_rejects_min_max() -> None:
    with pytest.raises(AssertionError):
        QuantizedTensor(torch.zeros(3), _block_info(), min_value=torch.zeros(1), max_value=torch.ones(1))


def _bf16_list(computation_dtype: torch.dtype = torch.float32) -> QuantizedTensorList:
    values = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3.0], dtype=torch.bfloat16)]
    return QuantizedTensorList([(value, None, None) for value in values], torch.bfloat16, computation_dtype)


def test_list_from_quantized_tensors_uses_their_storage() -> None:
    modules = [_fp16_tensor(), _fp16_tensor()]
    quantized_list = QuantizedTensorList(modules, torch.float16)
    assert len(quantized_list) == 2
    assert all(a is m.quantized_values for a, m in zip(quantized_list.quantized_value, modules, strict=True))


def test_list_rejects_other_element_types() -> None:
    with pytest.raises(TypeError, match="QuantizedTensor or of \\(values, min_value, max_value\\) tuples"):
        QuantizedTensorList([torch.zeros(2)], torch.float32)  # type: ignore[arg-type]


def test_list_rejects_non_float_computation_dtype() -> None:
    with pytest.raises(AssertionError, match=r"computation_dtype=torch\.int32 is not one of"):
        _bf16_list(torch.int32)


def test_list_rejects_values_of_another_dtype() -> None:
    with pytest.raises(AssertionError, match="quantized_dtype"):
        QuantizedTensorList([(torch.zeros(2), None, None)], torch.float16)


def test_len_and_compress() -> None:
    quantized_list = _bf16_list()
    assert len(quantized_list) == 2
    compressed = quantized_list.compress((False, True))
    assert len(compressed) == 1
    assert compressed.dequantize()[0].tolist() == [3.0]


def test_same_dtype_dequantize_returns_stored_values_and_stores_nothing() -> None:
    quantized_list = _bf16_list(torch.bfloat16)
    assert quantized_list.dequantize() is quantized_list.quantized_value
    assert not quantized_list.is_dequantized_stored()


def test_out_of_place_round_trip() -> None:
    quantized_list = _bf16_list()
    dequantized = quantized_list.dequantize()
    assert [value.dtype for value in dequantized] == [torch.float32, torch.float32]
    quantized_list.quantize([value * 2 for value in dequantized])
    assert [value.tolist() for value in quantized_list.quantized_value] == [[2.0, 4.0], [6.0]]
    assert quantized_list.quantized_value[0].dtype == torch.bfloat16


def test_in_place_round_trip_through_context() -> None:
    quantized_list = _bf16_list()
    with DequantizeQuantizedTensorListContext(quantized_list):
        assert quantized_list.is_dequantized_stored()
        stored = quantized_list.dequantized_value
        assert stored is not None and stored[0].dtype == torch.float32
        stored[0].add_(0.5)
    assert not quantized_list.is_dequantized_stored()
    assert quantized_list.quantized_value[0].tolist() == [1.5, 2.5]
    assert quantized_list.quantized_value[0].dtype == torch.bfloat16


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_warnings_for_misuse(caplog: pytest.LogCaptureFixture) -> None:
    quantized_list = _bf16_list()
    with caplog.at_level(logging.WARNING):
        quantized_list.quantize_()
    assert len(_warnings(caplog)) == 1 and "call dequantize_() first" in _warnings(caplog)[0]

    caplog.clear()
    quantized_list.dequantize_()
    with caplog.at_level(logging.WARNING):
        quantized_list.dequantize_()
    assert len(_warnings(caplog)) == 1 and "already stored" in _warnings(caplog)[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quantized_list.quantize([torch.tensor([7.0, 8.0]), torch.tensor([9.0])])
    assert len(_warnings(caplog)) == 1 and "bypassed" in _warnings(caplog)[0]
    assert quantized_list.quantized_value[1].tolist() == [9.0]

    with pytest.raises(AssertionError, match="quantize_"):
        quantized_list.compress((True, True))


def test_context_writes_back_into_a_quantized_tensor() -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.tensor(SOURCE), torch.bfloat16, _block_info())
    quantized_list = QuantizedTensorList([quantized], torch.bfloat16)
    with DequantizeQuantizedTensorListContext(quantized_list):
        quantized_list.dequantized_value[0].mul_(2.0)  # type: ignore[index]
    assert quantized.quantized_values.tolist() == [2.0, 5.0, 0.66796875]
