"""`OptimizerModule`: optimizer state objects that turn themselves into nested tensor dicts and back.

Like `nn.Module.state_dict`, but for plain Python objects holding optimizer state: every attribute
is walked recursively, containers become dicts keyed by name or position, and loading copies into
the existing tensors so that references held elsewhere (views, distributed buffers) stay valid.
"""

import logging
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor

logger: logging.Logger = logging.getLogger(__name__)

# Marks a value that contributes nothing to a state dict (as opposed to a stored `None`).
_OMITTED = object()

_SEQUENCE_TYPES = (list, tuple, set)


class OptimizerModule:
    """Base class for optimizer state containers with a recursive `state_dict` / `load_state_dict`."""

    def state_dict(
        self, destination: dict[str, Any] | None = None, keep_vars: bool = False, store_non_tensors: bool = False
    ) -> dict[str, Any]:
        """Return this object's attributes as a nested dict.

        Tensors are stored detached (unless `keep_vars`); nested modules become their own dicts
        (kept even when empty); dicts and lists/tuples/sets become dicts keyed by name or position
        and are dropped when nothing inside them was stored; other values are stored only with
        `store_non_tensors` (`None` included). If `destination` is given it is filled and returned.
        """
        if destination is None:
            destination = {}
        for name, value in vars(self).items():
            entry = _to_state(value, keep_vars, store_non_tensors)
            if entry is not _OMITTED:
                destination[name] = entry
        return destination

    def load_state_dict(self, state_dict: Mapping[Any, Any], store_non_tensors: bool = False) -> None:
        """Merge `state_dict` into this object, copying tensors in place.

        Only attributes present in both are loaded. String position keys ("0", "1", …, as produced
        by flattening a checkpoint) are accepted for list/tuple/set attributes. Non-tensor values are
        replaced (by a deep copy) only with `store_non_tensors` and an exactly matching type;
        mismatches are logged as warnings and leave the current value in place.
        """
        for name, current in vars(self).items():
            if name in state_dict:
                setattr(self, name, _load_value(current, state_dict[name], store_non_tensors))


def _to_state(value: object, keep_vars: bool, store_non_tensors: bool) -> Any:
    """State-dict entry for one value, or `_OMITTED`."""
    if isinstance(value, Tensor):
        return value if keep_vars else value.detach()
    if isinstance(value, OptimizerModule):
        return value.state_dict(keep_vars=keep_vars, store_non_tensors=store_non_tensors)
    if isinstance(value, dict):
        return _non_empty_or_omitted(value.items(), keep_vars, store_non_tensors)
    if isinstance(value, _SEQUENCE_TYPES):
        return _non_empty_or_omitted(enumerate(value), keep_vars, store_non_tensors)
    return value if store_non_tensors else _OMITTED


def _non_empty_or_omitted(items: Any, keep_vars: bool, store_non_tensors: bool) -> Any:
    entries = {key: _to_state(value, keep_vars, store_non_tensors) for key, value in items}
    stored = {key: entry for key, entry in entries.items() if entry is not _OMITTED}
    return stored if stored else _OMITTED


def _load_value(current: Any, incoming: Any, store_non_tensors: bool) -> Any:
    """Return the value that replaces `current` after loading `incoming` into it."""
    if isinstance(current, Tensor):
        return _load_tensor(current, incoming)
    if isinstance(current, OptimizerModule):
        if not isinstance(incoming, dict):
            logger.warning(
                f"Expected a dict to load into {type(current).__name__}, got {type(incoming).__name__}; "
                "keeping the current value."
            )
            return current
        current.load_state_dict(incoming, store_non_tensors=store_non_tensors)
        return current
    if isinstance(current, dict):
        return _load_dict(current, incoming, store_non_tensors)
    if isinstance(current, _SEQUENCE_TYPES):
        return _load_sequence(current, incoming, store_non_tensors)
    if not store_non_tensors:
        return current
    if type(incoming) is not type(current):
        logger.warning(
            f"Type mismatch: current value has type {type(current).__name__} but the loaded value has type "
            f"{type(incoming).__name__}; keeping the current value."
        )
        return current
    return deepcopy(incoming)


def _load_tensor(current: Tensor, incoming: Any) -> Tensor:
    if not isinstance(incoming, Tensor):
        logger.warning(
            f"Both values must be tensors to load, but the loaded value has type {type(incoming).__name__}; "
            "keeping the current tensor."
        )
        return current
    with torch.no_grad():
        current.copy_(incoming)
    return current


def _load_dict(current: dict[Any, Any], incoming: Any, store_non_tensors: bool) -> dict[Any, Any]:
    if not isinstance(incoming, dict):
        logger.warning(
            f"Expected a dict to load into a dict, got {type(incoming).__name__}; keeping the current value."
        )
        return current
    for key in current.keys() & incoming.keys():
        current[key] = _load_value(current[key], incoming[key], store_non_tensors)
    return current


def _is_loadable(value: object, store_non_tensors: bool) -> bool:
    return store_non_tensors or isinstance(value, (Tensor, OptimizerModule, dict, *_SEQUENCE_TYPES))


def _load_sequence(current: Any, incoming: Any, store_non_tensors: bool) -> Any:
    """Load a position-keyed dict into a list/tuple/set, building a new container of the same type."""
    if not isinstance(incoming, dict):
        logger.warning(
            f"Expected a position-keyed dict to load into a {type(current).__name__}, got {type(incoming).__name__}; "
            "keeping the current value."
        )
        return current
    by_position = _int_keyed(incoming)
    loaded = []
    for position, element in enumerate(current):
        if not _is_loadable(element, store_non_tensors):
            loaded.append(element)
            continue
        if position not in by_position:
            raise KeyError(
                f"Position {position} of a {type(current).__name__} is missing from the state dict to load; "
                f"available keys: {sorted(map(str, incoming))}."
            )
        loaded.append(_load_value(element, by_position[position], store_non_tensors))
    if hasattr(current, "_fields"):  # named tuples take their fields positionally
        return type(current)(*loaded)
    return type(current)(loaded)


def _int_keyed(incoming: dict[Any, Any]) -> dict[Any, Any]:
    """Map string position keys ("0", "1", …) back to ints; checkpoint flattening stringifies them."""
    if all(isinstance(key, int) for key in incoming):
        return incoming
    return {int(key) if isinstance(key, str) and key.isdigit() else key: value for key, value in incoming.items()}
