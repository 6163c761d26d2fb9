"""Optimizer state stored in a low-precision float dtype and computed on in a higher one.

"Quantization" here is only a dtype conversion between float dtypes; integer storage (which would
need min/max scaling) is reserved in the interface but not implemented.
"""

import logging
from collections.abc import Sequence
from operator import methodcaller
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from distributed_shampoo.utils.optimizer_modules import OptimizerModule
from distributed_shampoo.utils.shampoo_utils import ParameterizeEnterExitContext, compress_list

if TYPE_CHECKING:  # the distributor package imports utils, so import BlockInfo for annotations only
    from distributed_shampoo.distributor.shampoo_block_info import BlockInfo

logger: logging.Logger = logging.getLogger(__name__)

_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

QuantizedTriple = tuple[Tensor, Tensor | None, Tensor | None]


def _not_supported(dtype: torch.dtype) -> NotImplementedError:
    return NotImplementedError(f"Quantization for {dtype} is not yet supported; use one of {_FLOAT_DTYPES}.")


class QuantizedTensor(OptimizerModule):
    """One state tensor kept in `quantized_values.dtype`, with optional min/max for integer storage."""

    def __init__(
        self,
        quantized_values: Tensor,
        block_info: "BlockInfo",
        min_value: Tensor | None = None,
        max_value: Tensor | None = None,
    ) -> None:
        if quantized_values.dtype in _FLOAT_DTYPES:
            assert min_value is None and max_value is None, (
                f"Float storage ({quantized_values.dtype}) takes no min_value/max_value."
            )
        elif min_value is None and max_value is None:
            assert not torch.any(quantized_values), "Integer storage without min/max must start as all zeros."
            min_value = block_info.allocate_zeros_tensor((1,), dtype=torch.float32, device=quantized_values.device)
            max_value = block_info.allocate_zeros_tensor((1,), dtype=torch.float32, device=quantized_values.device)
        self.quantized_values = quantized_values
        self.block_info = block_info
        self.min_value = min_value
        self.max_value = max_value

    @classmethod
    def init_from_dequantized_tensor(
        cls, dequantized_values: Tensor, quantized_dtype: torch.dtype, block_info: "BlockInfo"
    ) -> "QuantizedTensor":
        """Allocate storage of `quantized_dtype` through `block_info` and copy `dequantized_values` into it."""
        if quantized_dtype not in _FLOAT_DTYPES:
            raise _not_supported(quantized_dtype)
        quantized_values = block_info.allocate_zeros_tensor(
            dequantized_values.shape, dtype=quantized_dtype, device=dequantized_values.device
        )
        block_info.get_tensor(quantized_values).copy_(dequantized_values)
        return cls(quantized_values, block_info)

    def dequantize(self, dequantized_dtype: torch.dtype) -> Tensor:
        """The values in `dequantized_dtype`: the stored tensor itself if the dtype already matches."""
        if self.quantized_values.dtype == dequantized_dtype:
            return self.quantized_values
        if self.quantized_values.dtype not in _FLOAT_DTYPES:
            raise _not_supported(self.quantized_values.dtype)
        return self.quantized_values.to(dtype=dequantized_dtype)

    def quantize(self, tensor: Tensor) -> None:
        """Store `tensor` (converted to the storage dtype)."""
        if self.quantized_values.dtype not in _FLOAT_DTYPES:
            raise _not_supported(self.quantized_values.dtype)
        self.quantized_values.copy_(tensor)


class QuantizedTensorList:
    """A list of quantized tensors that can be dequantized (all together) for computation.

    Either call `dequantize()` / `quantize(values)` explicitly, or use
    `DequantizeQuantizedTensorListContext`, which stores dequantized copies on entry
    (`dequantize_`) and writes them back on exit (`quantize_`).
    """

    def __init__(
        self,
        quantized_data: Sequence[QuantizedTensor] | Sequence[QuantizedTriple],
        quantized_dtype: torch.dtype,
        computation_dtype: torch.dtype = torch.float32,
    ) -> None:
        values, min_values, max_values = _unpack(quantized_data)
        assert all(value.dtype == quantized_dtype for value in values), (
            f"All quantized values must have {quantized_dtype=}; got {sorted({str(value.dtype) for value in values})}."
        )
        assert computation_dtype in _FLOAT_DTYPES, f"{computation_dtype=} is not one of {_FLOAT_DTYPES}."
        for name, bounds in (("min_values", min_values), ("max_values", max_values)):
            assert len({bound is None for bound in bounds}) <= 1, f"{name} must be all None or all tensors."
        self.quantized_dtype = quantized_dtype
        self.computation_dtype = computation_dtype
        self._quantized_values: tuple[Tensor, ...] = values
        self._min_values: tuple[Tensor | None, ...] = min_values
        self._max_values: tuple[Tensor | None, ...] = max_values
        self._dequantized_values: tuple[Tensor, ...] | None = None

    def __len__(self) -> int:
        return len(self._quantized_values)

    @property
    def quantized_value(self) -> tuple[Tensor, ...]:
        return self._quantized_values

    @property
    def dequantized_value(self) -> tuple[Tensor, ...] | None:
        """The values stored by `dequantize_()`, or `None` if nothing is stored."""
        return self._dequantized_values

    def is_dequantized_stored(self) -> bool:
        return self._dequantized_values is not None

    def dequantize(self) -> tuple[Tensor, ...]:
        """Values in the computation dtype; the stored tuple itself when no conversion is needed."""
        if self.quantized_dtype == self.computation_dtype:
            return self._quantized_values
        if self.quantized_dtype not in _FLOAT_DTYPES:
            raise _not_supported(self.quantized_dtype)
        return tuple(value.to(dtype=self.computation_dtype) for value in self._quantized_values)

    def dequantize_(self) -> None:
        """Dequantize and keep the result (see `dequantized_value`) until `quantize_()`."""
        if self._dequantized_values is not None:
            logger.warning("Dequantized values are already stored; overwriting them with a fresh dequantization.")
        self._dequantized_values = self.dequantize()

    def quantize(self, tensor_list: Sequence[Tensor]) -> None:
        """Copy `tensor_list` into the quantized storage."""
        if self._dequantized_values is not None and tensor_list is not self._dequantized_values:
            logger.warning(
                "Quantizing values other than the stored dequantized ones; the stored dequantized values are bypassed."
            )
        if self.quantized_dtype not in _FLOAT_DTYPES:
            raise _not_supported(self.quantized_dtype)
        assert len(tensor_list) == len(self), f"Expected {len(self)} tensors, got {len(tensor_list)}."
        for stored, value in zip(self._quantized_values, tensor_list, strict=True):
            if stored is not value:
                stored.copy_(value)

    def quantize_(self) -> None:
        """Write the values stored by `dequantize_()` back (if dtypes differ) and forget them."""
        if self._dequantized_values is None:
            logger.warning(
                "No dequantized values are stored, so there is nothing to quantize; call dequantize_() first."
            )
            return
        if self.quantized_dtype != self.computation_dtype:
            self.quantize(self._dequantized_values)
        self._dequantized_values = None

    def compress(self, selector: Sequence[bool]) -> "QuantizedTensorList":
        """A new list holding only the selected entries (nothing may be dequantized-and-stored)."""
        assert self._dequantized_values is None, "Call quantize_() before compress(): dequantized values are stored."
        triples = compress_list(list(zip(self._quantized_values, self._min_values, self._max_values)), selector)
        return QuantizedTensorList(triples, self.quantized_dtype, self.computation_dtype)


def _unpack(
    quantized_data: Sequence[QuantizedTensor] | Sequence[QuantizedTriple],
) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
    """Split the accepted input forms into (values, min values, max values), local tensors only."""
    if all(isinstance(item, QuantizedTensor) for item in quantized_data):
        modules: Sequence[QuantizedTensor] = quantized_data  # type: ignore[assignment]
        return (
            tuple(module.block_info.get_tensor(module.quantized_values) for module in modules),
            tuple(None if m.min_value is None else m.block_info.get_tensor(m.min_value) for m in modules),
            tuple(None if m.max_value is None else m.block_info.get_tensor(m.max_value) for m in modules),
        )
    if all(isinstance(item, tuple) and len(item) == 3 for item in quantized_data):
        triples: Sequence[QuantizedTriple] = quantized_data  # type: ignore[assignment]
        return tuple(t[0] for t in triples), tuple(t[1] for t in triples), tuple(t[2] for t in triples)
    raise TypeError(
        "quantized_data must be a sequence of QuantizedTensor or of (values, min_value, max_value) tuples; "
        f"got element types {sorted({type(item).__name__ for item in quantized_data})}."
    )


class DequantizeQuantizedTensorListContext(ParameterizeEnterExitContext[QuantizedTensorList]):
    """`with DequantizeQuantizedTensorListContext(qtl):` work on `qtl.dequantized_value`; written back on exit."""

    def __init__(self, quantized_tensor_list: QuantizedTensorList) -> None:
        super().__init__(
            input_with_enter_exit_context=quantized_tensor_list,
            enter_method_caller=methodcaller("dequantize_"),
            exit_method_caller=methodcaller("quantize_"),
        )
