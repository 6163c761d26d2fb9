"""FSDP helpers. Sharded (FSDP/HSDP/fully_shard) training is not supported by this package yet."""

from typing import Any

from torch import nn

_NOT_SUPPORTED = (
    "FSDP-sharded parameters are not supported by this distributed_shampoo: keep parameters replicated and use "
    "DDPDistributedConfig (or SingleDeviceDistributedConfig for one process)."
)


def compile_fsdp_parameter_metadata(module: nn.Module) -> dict[Any, Any]:
    """Would map each original parameter to its place in the FSDP1 flat parameter; raises NotImplementedError."""
    raise NotImplementedError(_NOT_SUPPORTED)
