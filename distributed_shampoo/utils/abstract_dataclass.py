"""A dataclass base that cannot be instantiated until a concrete subclass generates `__init__`."""

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(init=False)
class AbstractDataclass(ABC):
    """Base for configuration dataclasses that only exist to be subclassed.

    `__init__` is abstract, so the class (and every subclass declared with
    `@dataclass(init=False)`) raises `TypeError` when instantiated. A subclass declared with a plain
    `@dataclass` gets a generated `__init__`; `dataclasses` then refreshes the abstract-method set,
    which makes that subclass concrete even when it adds no fields.
    """

    @abstractmethod
    def __init__(self) -> None: ...
