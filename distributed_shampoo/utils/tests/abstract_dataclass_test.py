from dataclasses import dataclass

import pytest

from distributed_shampoo.utils.abstract_dataclass import AbstractDataclass


@dataclass(init=False)
class _StillAbstract(AbstractDataclass):
    pass


@dataclass
class _Concrete(_StillAbstract):
    x: int = 1


@dataclass
class _ConcreteWithoutFields(AbstractDataclass):
    pass


@pytest.mark.parametrize("cls", [AbstractDataclass, _StillAbstract])
def test_abstract_classes_cannot_be_instantiated(cls: type) -> None:
    with pytest.raises(TypeError, match=f"^Can't instantiate abstract class {cls.__name__} "):
        cls()


def test_plain_dataclass_subclass_is_concrete() -> None:
    assert _Concrete() == _Concrete(x=1)
    assert _Concrete(x=3).x == 3
    # mypy cannot see that the generated __init__ overrides the abstract one.
    assert _ConcreteWithoutFields() == _ConcreteWithoutFields()  # type: ignore[abstract]
