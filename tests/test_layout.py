"""The package's layout: one public face per concern, no function shadowing a module, layers checked."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import pkgutil
import tomllib
import types

import pytest

import fmp

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_PACKAGES = ["fmp", *(f"fmp.{name}" for name in ("autocast", "debug", "interop", "nn", "optim", "remat"))]
PUBLIC_PACKAGES += ["fmp.serialization", "fmp.distributed", "fmp.optim.schedule", "fmp.fp8"]


def contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return found


def test_every_core_module_is_bound_by_the_core_contract() -> None:
    core = next(c for c in contracts() if c["type"] == "forbidden")
    modules = {f"fmp.{path.stem}" for path in (ROOT / "fmp").glob("_*.py") if path.stem != "__init__"}
    assert modules and modules <= set(core["source_modules"])  # type: ignore[arg-type]


def test_every_subpackage_is_in_a_layer_or_the_core() -> None:
    layered = {
        name.strip()
        for contract in contracts()
        if contract["type"] == "layers"
        for layer in contract["layers"]  # type: ignore[attr-defined]
        for name in layer.split("|")
    }
    core = next(c for c in contracts() if c["type"] == "forbidden")
    subpackages = {info.name for info in pkgutil.iter_modules(fmp.__path__) if info.ispkg}
    core_packages = {name.removeprefix("fmp.") for name in core["source_modules"]} & subpackages  # type: ignore[attr-defined]
    assert core_packages == {"autocast"}
    assert subpackages == layered | core_packages


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_public_names_resolve_and_no_function_shadows_a_module(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        submodule = f"{package}.{name}"
        if hasattr(module, "__path__") and importlib.util.find_spec(submodule) is not None:
            assert isinstance(value, types.ModuleType), f"{submodule} is a module shadowed by {value!r}"


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_implementation_modules_are_private(package: str) -> None:
    module = importlib.import_module(package)
    if not hasattr(module, "__path__"):
        return
    for info in pkgutil.iter_modules(module.__path__):
        public = f"{package}.{info.name}"
        assert info.name.startswith("_") or public in PUBLIC_PACKAGES, f"{public} is neither private nor a public face"


def test_state_classes_are_pickled_by_public_names_that_resolve_to_them() -> None:
    """The rule: a state class is named by the public namespace that exports it (fmp.TrainState,
    fmp.optim.AdamState), never by the private module that defines it, so moving code between
    private modules never breaks a saved file."""
    from fmp._struct import state_classes

    for cls in state_classes():
        name = f"{cls.__module__}.{cls.__qualname__}"
        assert not any(part.startswith("_") for part in cls.__module__.split(".")), name
        assert cls.__qualname__ in importlib.import_module(cls.__module__).__all__, name
        assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls, name


def test_state_classes_keep_resolvable_annotations() -> None:
    import typing

    from fmp._struct import state_classes

    for cls in state_classes():
        hints = typing.get_type_hints(cls)  # raised NameError once the classes moved to public modules
        assert all(not isinstance(hint, str) for hint in hints.values()), cls


def test_every_legacy_name_leads_to_a_state_class() -> None:
    from fmp._struct import LEGACY_NAMES
    from fmp._struct import state_classes

    current = {f"{cls.__module__}.{cls.__qualname__}" for cls in state_classes()}
    assert set(LEGACY_NAMES.values()) <= current
    assert "fmp._accumulate.AccumulatedGradients" in LEGACY_NAMES
