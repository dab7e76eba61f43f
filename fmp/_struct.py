"""Immutable dataclasses that are pytrees for both `torch.utils._pytree` and optree.

`torch.func` and `torch.compile` read pytrees through `torch.utils._pytree`; optree users read them
through the namespace `OPTREE_NAMESPACE`. Tensor fields are leaves; fields declared with
`static_field()` are configuration and live in the treespec, so they survive every round trip.
Both decorators also allow the class in `torch.load(weights_only=True)`, so a saved state loads
with torch's safe default and no extra context.

Names in files: a decorated class of fmp takes its public name as `__module__` (`fmp.TrainState`,
`fmp.optim.AdamState`, not the private modules that define them), so pickles and serialized
treespecs survive moves between private modules. The names earlier fmp versions wrote stay
readable through `LEGACY_NAMES`, the compatibility table below.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import typing
from collections.abc import Iterable
from typing import Any
from typing import TypeVar

import optree
import torch
import torch.utils._pytree as torch_pytree
from typing_extensions import dataclass_transform

__all__ = [
    "LEGACY_NAMES",
    "OPTREE_NAMESPACE",
    "ZERO_PADDED",
    "current_name",
    "dataclass_fields",
    "pytree_dataclass",
    "replace",
    "resolve_annotations",
    "serializable_namedtuple",
    "state_classes",
    "static_field",
]

OPTREE_NAMESPACE = "fmp"
"""The optree namespace fmp's state classes are registered under: `optree.tree_flatten(x, namespace=...)`."""

_STATIC = "fmp_static"
# (class, field names, leaf field names, static field names): a subclass inherits the attribute but not its fields.
_FIELDS = "_fmp_fields"

T = TypeVar("T")

# Every class the decorators below registered, in order of definition.
_STATE_CLASSES: list[type] = []

LEGACY_NAMES: dict[str, str] = {
    # Written by fmp before the layout by concern (commit e53d265): public modules of their own.
    "fmp.state.TrainState": "fmp.TrainState",
    "fmp.state.StepCounts": "fmp.StepCounts",  # 4 counts then: see ZERO_PADDED
    "fmp.loss_scale.NoOpLossScale": "fmp.NoOpLossScale",
    "fmp.loss_scale.StaticLossScale": "fmp.StaticLossScale",
    "fmp.loss_scale.DynamicLossScale": "fmp.DynamicLossScale",
    "fmp.accumulate.GradientAccumulator": "fmp.GradientAccumulator",
    "fmp.accumulate.AccumulatedGradients": "fmp.AccumulatedGradients",
    "fmp.grad.Gradients": "fmp.Gradients",
    "fmp.step.StepInfo": "fmp.StepInfo",
    "fmp.optim.adam.AdamState": "fmp.optim.AdamState",
    "fmp.optim.sgd.SgdState": "fmp.optim.SgdState",
    "fmp.optim.ema.EmaState": "fmp.optim.EmaState",
    "fmp.optim.stochastic_rounding.StochasticRoundingState": "fmp.optim.StochasticRoundingState",
    # Written from the layout by concern until the stable public names: the private defining modules.
    "fmp._state.TrainState": "fmp.TrainState",
    "fmp._state.StepCounts": "fmp.StepCounts",  # 4 counts at e53d265, 6 since
    "fmp._loss_scale.NoOpLossScale": "fmp.NoOpLossScale",
    "fmp._loss_scale.StaticLossScale": "fmp.StaticLossScale",
    "fmp._loss_scale.DynamicLossScale": "fmp.DynamicLossScale",
    "fmp._accumulate.GradientAccumulator": "fmp.GradientAccumulator",
    "fmp._accumulate.AccumulatedGradients": "fmp.AccumulatedGradients",
    "fmp._grad.Gradients": "fmp.Gradients",
    "fmp._step.StepInfo": "fmp.StepInfo",
    "fmp.optim._adam.AdamState": "fmp.optim.AdamState",
    "fmp.optim._sgd.SgdState": "fmp.optim.SgdState",
    "fmp.optim._ema.EmaState": "fmp.optim.EmaState",
    "fmp.optim._stochastic_rounding.StochasticRoundingState": "fmp.optim.StochasticRoundingState",
}
"""Compatibility table: a name an earlier fmp wrote into pickles (and treespecs) -> the class's name now.

`torch.load(weights_only=True)` rebuilds each legacy name as the current class (fields unchanged,
except as `ZERO_PADDED` says). Add an entry whenever a state class's public name changes.
"""

ZERO_PADDED: dict[str, tuple[int, ...]] = {"fmp.StepCounts": (4,)}
"""NamedTuples that gained trailing tensor fields, with the field counts earlier fmp versions pickled
(StepCounts gained `bad_scale` and `bad_update`): such a pickle loads with the missing fields zero,
of the first field's shape, dtype and device."""


def current_name(name: str) -> str:
    """The name a state class has now, for a name (current or in `LEGACY_NAMES`) found in a file."""
    return LEGACY_NAMES.get(name, name)


def _public_module(module: str) -> str:
    """`fmp._state` -> `fmp`, `fmp.optim._adam` -> `fmp.optim`: the module up to its first private part."""
    parts = module.split(".")
    if parts[0] != "fmp":  # a class of another package (a test's) keeps its module
        return module
    public = []
    for part in parts:
        if part.startswith("_"):
            break
        public.append(part)
    return ".".join(public)


# Each renamed class -> the module that defines it, whose names its annotations use.
_DEFINED_IN: dict[type, str] = {}


def _name_publicly(cls: type) -> None:
    """Sets `cls.__module__` to its public namespace, which exports it (see `resolve_annotations`).

    A class of the core that a subpackage exports (the core's step threads it, the subpackage
    documents it) names that namespace in a `PUBLIC_NAMESPACE` class attribute.
    """
    _DEFINED_IN[cls] = cls.__module__
    cls.__module__ = cls.__dict__.get("PUBLIC_NAMESPACE") or _public_module(cls.__module__)


def resolve_annotations() -> None:
    """Resolves the renamed classes' field annotations in the modules that define them.

    They are strings (`from __future__ import annotations`) naming what the defining module
    imported, which `typing.get_type_hints` would look up in the public module. Called once fmp is
    imported, when the classes they may name further down their modules exist.
    """
    for cls, module in _DEFINED_IN.items():
        cls.__annotations__ = typing.get_type_hints(cls, globalns=vars(sys.modules[module]))
    _DEFINED_IN.clear()


def _check_padding_model(name: str, fields: tuple[Any, ...]) -> None:
    """Refuses fields the padding cannot be modelled on: non-tensors, differing shapes, expanded views.

    An expanded tensor costs a file a few bytes whatever its shape; zeros of that shape would not.
    """
    first = fields[0]
    for field in fields:
        if not isinstance(field, torch.Tensor) or field.shape != first.shape or 0 in field.stride():
            raise pickle.UnpicklingError(
                f"a legacy {name} must hold tensors of one shape, each stored whole; this file's are not"
            )


def _zero_padding_loader(cls: type, legacy_widths: tuple[int, ...]) -> type:
    """A stand-in for `cls` in the unpickler's NEWOBJ (`loader.__new__(loader, *fields)`): pads to `cls`'s fields."""
    width = len(cls._fields)  # type: ignore[attr-defined]

    class Loader:
        def __new__(loader: type, *fields: Any) -> Any:
            if len(fields) in legacy_widths:
                _check_padding_model(cls.__qualname__, fields)
                like = fields[0]
                padding = (
                    torch.zeros(like.shape, dtype=like.dtype, device=like.device) for _ in range(width - len(fields))
                )
                fields = (*fields, *padding)
            return cls(*fields)

    Loader.__qualname__ = Loader.__name__ = f"Legacy{cls.__qualname__}"
    Loader.__module__ = __name__
    return Loader


def _allow_in_checkpoints(cls: type) -> None:
    _STATE_CLASSES.append(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    loader = _zero_padding_loader(cls, ZERO_PADDED[name]) if name in ZERO_PADDED else cls
    legacy = [(loader, old) for old, new in LEGACY_NAMES.items() if new == name]
    torch.serialization.add_safe_globals([cls, *legacy])


def state_classes() -> list[type]:
    """Fmp's state classes, which `torch.load(weights_only=True)` is allowed to rebuild.

    They are allowed when fmp is imported; the list serves a loader with an allow-list of its own
    (`torch.serialization.safe_globals(...)`).

    Returns:
        The classes, a fresh list.
    """
    return list(_STATE_CLASSES)


def static_field(**kwargs: Any) -> Any:
    """Declares a dataclass field that is configuration: kept in the treespec, never a leaf."""
    return dataclasses.field(metadata={_STATIC: True}, **kwargs)


def replace(obj: T, **changes: Any) -> T:
    """A copy of a `pytree_dataclass` instance with some fields replaced, as `dataclasses.replace`.

    Traced code must not call `dataclasses.replace`: Dynamo guards on every entry of the class's
    `__dataclass_fields__` it reads, and evaluates those guards on every call of a compiled step.
    This reads one tuple of field names.

    Args:
        obj: An instance of a class decorated with `pytree_dataclass` (not of a subclass of one).
        **changes: New values by field name.

    Returns:
        A new instance of `type(obj)`.

    Raises:
        TypeError: If `obj`'s class is not a `pytree_dataclass`, or a name in `changes` is not a field.
    """
    owner, names, _, _ = getattr(type(obj), _FIELDS, (None, (), (), ()))
    if owner is not type(obj):
        raise TypeError(f"replace() takes an instance of a pytree_dataclass, got {type(obj).__qualname__}")
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no fields {unknown}; its fields are {list(names)}")
    return type(obj)(**{name: changes[name] if name in changes else getattr(obj, name) for name in names})


def dataclass_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """`(leaf field names, static field names)` of a `pytree_dataclass` (not of a subclass of one), else None."""
    owner, _, leaf_names, static_names = getattr(cls, _FIELDS, (None, (), (), ()))
    return (leaf_names, static_names) if owner is cls else None


@dataclass_transform(frozen_default=True, eq_default=False, field_specifiers=(dataclasses.field, static_field))
def pytree_dataclass(cls: type[T]) -> type[T]:
    """Makes `cls` a frozen dataclass registered as a pytree node with torch and optree.

    The constructor stays trivial (unflattening calls it with whatever the leaves are, including
    batched or fake tensors); validation belongs in a `create()` classmethod.
    """
    # eq=False: a value comparison of tensor fields would read them on the host (and fails on
    # batched states); identity equality and hashing stay consistent.
    data_cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(data_cls)  # type: ignore[arg-type]
    not_in_init = [f.name for f in fields if not f.init]
    if not_in_init:  # unflattening passes every field to the constructor
        raise TypeError(f"pytree_dataclass {cls.__qualname__}: fields {not_in_init} must not be init=False")
    leaf_names = tuple(f.name for f in fields if not f.metadata.get(_STATIC, False))
    static_names = tuple(f.name for f in fields if f.metadata.get(_STATIC, False))
    setattr(data_cls, _FIELDS, (data_cls, tuple(f.name for f in fields), leaf_names, static_names))
    _name_publicly(data_cls)  # after dataclass(), which resolves annotations in the defining module

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in leaf_names], tuple(getattr(obj, n) for n in static_names)

    def unflatten(leaves: Iterable[Any], static: tuple[Any, ...]) -> Any:
        return data_cls(**dict(zip(leaf_names, leaves, strict=True)), **dict(zip(static_names, static, strict=True)))

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        leaves, static = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), v) for n, v in zip(leaf_names, leaves, strict=True)], static

    torch_pytree.register_pytree_node(
        data_cls,
        flatten,
        unflatten,
        serialized_type_name=f"{data_cls.__module__}.{data_cls.__qualname__}",
        # JSON turns the static tuple into a list; restore it so serialized treespecs compare equal.
        to_dumpable_context=list,
        from_dumpable_context=tuple,
        flatten_with_keys_fn=flatten_with_keys,
    )
    optree.register_pytree_node(
        data_cls,  # type: ignore[arg-type]
        lambda obj: (*flatten(obj), leaf_names),
        lambda static, leaves: unflatten(leaves, static),  # type: ignore[arg-type]
        path_entry_type=optree.GetAttrEntry,
        namespace=OPTREE_NAMESPACE,
    )
    _allow_in_checkpoints(data_cls)
    return data_cls


NamedTupleT = TypeVar("NamedTupleT", bound=type)


def serializable_namedtuple(cls: NamedTupleT) -> NamedTupleT:
    """Class decorator: gives a NamedTuple a name in torch's serialized treespecs, and allows it in checkpoints.

    Every NamedTuple is a pytree, but `torch.utils._pytree.treespec_dumps` (and so `torch.export.save`
    of a program taking or returning fmp's state) refuses one registered without a name.
    """
    _name_publicly(cls)
    torch_pytree._register_namedtuple(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    _allow_in_checkpoints(cls)
    return cls
