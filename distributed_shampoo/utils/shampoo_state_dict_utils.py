"""Convert per-parameter optimizer state to plain nested dicts and load such dicts back in place."""

import logging
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor

from distributed_shampoo.utils.optimizer_modules import OptimizerModule

logger: logging.Logger = logging.getLogger(__name__)


def extract_state_dict_content(input_dict: Mapping[Any, Any]) -> dict[Any, Any]:
    """Copy `input_dict` recursively, replacing every `OptimizerModule` by its `state_dict()`.

    Other values (tensors, ints, …) are kept as they are, so the result shares tensors with the
    optimizer state.
    """
    return {key: _extract_value(value) for key, value in input_dict.items()}


def _extract_value(value: Any) -> Any:
    if isinstance(value, OptimizerModule):
        return value.state_dict()
    if isinstance(value, Mapping):
        return extract_state_dict_content(value)
    return value


def update_param_state_dict_object(
    current_param_state_dict: dict[Any, Any],
    param_state_dict_to_load: Mapping[Any, Any],
    enable_missing_key_check: bool = True,
) -> None:
    """Load `param_state_dict_to_load` into `current_param_state_dict`, keeping existing tensors.

    For every key of the current state: dicts recurse, objects with a `load_state_dict` method
    (`OptimizerModule`s) load their sub-dict, tensors are overwritten with `copy_`, and anything
    else is replaced by a deep copy of the loaded value. Keys only in the loaded dict are ignored.
    A key missing from the loaded dict raises `KeyError`, or with `enable_missing_key_check=False`
    is logged as a warning and left unchanged.
    """
    for key, current in current_param_state_dict.items():
        if key not in param_state_dict_to_load:
            message = f"Key {key} not found in state dict to load."  # the published wording
            if enable_missing_key_check:
                raise KeyError(message)
            logger.warning(f"{message} Keeping its current value.")
            continue
        to_load = param_state_dict_to_load[key]
        if isinstance(current, dict):
            update_param_state_dict_object(current, to_load, enable_missing_key_check)
        elif callable(getattr(current, "load_state_dict", None)):
            current.load_state_dict(to_load)
        elif isinstance(current, Tensor):
            with torch.no_grad():
                current.copy_(to_load)
        else:
            current_param_state_dict[key] = deepcopy(to_load)
