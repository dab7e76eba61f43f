"""`fp8_modules`: chosen `nn.Linear` layers of a model run in FP8, as a function transform.

As `fmp.autocast.module_policies` gives chosen submodules a policy of their own, `fp8_modules(fn,
model, {nn.Linear: fmp.fp8.tensorwise()})` returns `fn` run with each matched linear layer's
forward replaced by `fp8_linear` over the parameters in place when it runs (those
`functional_call` or `fmp.nn.call` swapped in), for the duration of the call only. The model is not
changed: its parameters, their names and its state dict stay what they were, so a checkpoint
trained in FP8 loads into the same model without it, and the rest of the model follows the
step's policy.

Layers on a delayed recipe read their scales from the `Fp8Scales` that `fmp.train_step` hands the
transformed function after the params, from the states of `TrainState.fp8`
(`init_states(model, recipes)`), keyed by the layers' names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

import torch
from torch import nn

from fmp._checks import check_callable
from fmp._delayed_scaling import DelayedScaling
from fmp._delayed_scaling import DelayedScalingState
from fmp._delayed_scaling import Fp8Scales
from fmp._fp8_step import TAKES_FP8_SCALES
from fmp.autocast._module_policy import ReadingForward
from fmp.autocast._module_policy import check_key
from fmp.autocast._module_policy import matched_modules
from fmp.autocast._module_policy import patched_forwards
from fmp.fp8._linear import Recipe
from fmp.fp8._linear import fp8_linear
from fmp.fp8._recipes import Fp8Recipe

__all__ = ["fp8_modules", "init_states"]

R = TypeVar("R")
Plan = list[tuple[str, nn.Linear, Recipe]]


def _check(model: Any, recipes: Any, caller: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} needs an nn.Module, got {type(model).__name__}")
    if not isinstance(recipes, Mapping) or not recipes:
        raise TypeError(
            f"recipes must be a non-empty mapping of module class or name pattern to recipe, got {recipes!r}"
        )
    named = list(model.named_modules(remove_duplicate=False))
    for key, recipe in recipes.items():
        if not isinstance(recipe, Fp8Recipe | DelayedScaling):
            raise TypeError(
                f"the recipe for {key!r} must be an fmp.fp8 recipe (tensorwise(), rowwise(), mxfp8(), blockwise() "
                f"or delayed()), got {type(recipe).__name__}"
            )
        # A class that matches no linear layer is named below, with the others, as matching no nn.Linear.
        check_key(key, named, "recipe", class_must_match=False)


def _plan(model: nn.Module, recipes: Mapping[Any, Recipe], caller: str) -> Plan:
    """The matched layers, each under the first of its names, with its recipe; validated."""
    _check(model, recipes, caller)
    plan: Plan = []
    for name, module, recipe in matched_modules(model, recipes):
        # Subclasses that keep nn.Linear's forward run it too (nn.MultiheadAttention's out_proj, whose
        # parent reads its weight directly, so that FP8 does not apply there, as with module_policies).
        if not (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward):
            raise TypeError(
                f"{caller} matched {name!r}, a {type(module).__name__} with a forward of its own: only "
                f"nn.Linear layers run in FP8; name the linear layers with patterns that leave it out"
            )
        plan.append((name, module, recipe))
    if not plan:
        raise ValueError(f"{caller}: the keys match no nn.Linear of the model")
    return plan


def init_states(
    model: nn.Module, recipes: Mapping[Any, Recipe], device: torch.device | str | None = None
) -> dict[str, DelayedScalingState]:
    """The delayed-scaling states of the layers `fp8_modules(fn, model, recipes)` runs on a delayed recipe.

    Pass them to `fmp.TrainState.create(..., fp8=...)`; `fmp.train_step` threads them.

    Args:
        model: The model, as given to `fp8_modules`.
        recipes: The same mapping.
        device: Where the states live (`TrainState.create` moves them to the params' device).

    Returns:
        Layer name -> a fresh `DelayedScalingState` (an empty dict when no layer is on a delayed recipe).

    Raises:
        TypeError, ValueError: As `fp8_modules`.
    """
    plan = _plan(model, recipes, "init_states")
    return {name: recipe.init(device) for name, _, recipe in plan if isinstance(recipe, DelayedScaling)}


class _DelayedForward(ReadingForward):
    """A delayed-scaling layer's forward: `fp8_linear` with the layer's scales, run once per call.

    Args:
        name: The layer's name, for the error.
        module: The layer.
        recipe: Its recipe.
        tensors: Its scales and the loss scale of the pass.
        calls: The delayed layers that ran in this call (shared by the call's forwards).
    """

    def __init__(
        self, name: str, module: nn.Linear, recipe: DelayedScaling, tensors: tuple[torch.Tensor, ...], calls: set[str]
    ) -> None:
        self.name, self.module, self.recipe, self._tensors, self.calls = name, module, recipe, tensors, calls

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    def reading(self, tensors: tuple[torch.Tensor, ...], *, counted: bool) -> _DelayedForward:
        return _DelayedForward(self.name, self.module, self.recipe, tensors, self.calls if counted else set())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.name in self.calls:
            raise RuntimeError(
                f"fp8_modules: the delayed-scaling layer {self.name!r} ran twice in one call: its scales' gradient "
                f"would add the amaxes of both runs, where delayed scaling takes one per step; give a layer "
                f"that runs several times a current-scaling recipe (tensorwise())"
            )
        self.calls.add(self.name)
        layer_scales, loss_scale = self._tensors
        # The parameters in place now: those functional_call swapped in, or the module's own.
        weight, bias = self.module.weight, self.module.bias
        return fp8_linear(x, weight, bias, recipe=self.recipe, scales=layer_scales, loss_scale=loss_scale)


def _fp8_forward(
    name: str, module: nn.Linear, recipe: Recipe, scales: Fp8Scales | None, calls: set[str]
) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(recipe, DelayedScaling):
        assert scales is not None  # delayed layers' functions take them (see _check_scales)
        return _DelayedForward(name, module, recipe, (scales.scales[name], scales.loss_scale), calls)

    def fp8_forward(x: torch.Tensor) -> torch.Tensor:
        # The parameters in place now: those functional_call swapped in, or the module's own.
        return fp8_linear(x, module.weight, module.bias, recipe=recipe)

    return fp8_forward


def _check_scales(scales: Any, plan: Plan) -> Fp8Scales:
    if not isinstance(scales, Fp8Scales):
        raise TypeError(
            f"this function runs layers on a delayed FP8 recipe, so it takes fmp.fp8.Fp8Scales after the params, "
            f"as fmp.train_step passes them from state.fp8; got {type(scales).__name__}"
        )
    delayed = [name for name, _, recipe in plan if isinstance(recipe, DelayedScaling)]
    missing = [name for name in delayed if not isinstance(scales.scales, dict) or name not in scales.scales]
    if missing:
        raise KeyError(
            f"state.fp8 holds no state for the delayed-scaling layers {missing}: make it with "
            f"fmp.fp8.init_states(model, recipes), the recipes given to fp8_modules"
        )
    return scales


def fp8_modules(fn: Callable[..., R], model: nn.Module, recipes: Mapping[Any, Recipe]) -> Callable[..., R]:
    """Returns `fn` run with chosen `nn.Linear` layers of `model` computing in FP8 per a recipe.

    Keys are module classes (matched with isinstance: `nn.Linear`) or fnmatch patterns over
    `model.named_modules()` names ("blocks.*.mlp.*"); a layer matched by several keys takes the
    first. Matched layers must be `nn.Linear` (or a subclass that keeps its forward). Their forward
    runs `fp8_linear(x, weight, bias, recipe=...)` (forward and both backward matmuls in FP8) on
    the parameters in place when it runs, so gradients reach the step's params as usual; outputs
    take the input's dtype, or autocast's under autocast. Nothing outlives the call. Works under
    `torch.func.grad`, `vmap`, `fmp.train_step` and `torch.compile(fullgraph=True)`.

    With a delayed recipe (`delayed()`) among them, the returned function takes an `Fp8Scales`
    after the params, `fn'(params, fp8_scales, *rest)` calling `fn(params, *rest)`: give the
    state `fp8=init_states(model, recipes)` and `fmp.train_step` passes the scales and updates the
    states (see [Delayed scaling](../how-to/fp8/delayed.md)).

    Example, every linear layer of a model in FP8 with per-tensor scales, the rest in bfloat16::

        loss = fmp.fp8.fp8_modules(loss_fn, model, {nn.Linear: fmp.fp8.tensorwise()})
        state, info = fmp.train_step(loss, state, batch, policy=policy, optimizer=optimizer)

    Args:
        fn: The function to transform; it calls `model` (usually through `fmp.nn.call`).
        model: The module whose submodules the keys match.
        recipes: Module class or name pattern -> an `fmp.fp8` recipe.

    Returns:
        A function with `fn`'s signature, or with `Fp8Scales` after the params for delayed recipes.

    Raises:
        TypeError: For a model that is not an nn.Module, a value that is not an fmp.fp8 recipe, a
            key that is neither an nn.Module subclass nor a string, or a matched module that is
            not an `nn.Linear`.
        ValueError: For a name pattern that matches no module, or keys that match no linear layer.
    """
    check_callable("fp8_modules' fn", fn)
    plan = _plan(model, recipes, "fp8_modules")

    def run(scales: Fp8Scales | None, *args: Any, **kwargs: Any) -> R:
        calls: set[str] = set()  # the delayed layers that ran in this call
        forwards = [(name, module, _fp8_forward(name, module, recipe, scales, calls)) for name, module, recipe in plan]
        with patched_forwards(forwards, "fp8_modules"):
            return fn(*args, **kwargs)

    if not any(isinstance(recipe, DelayedScaling) for _, _, recipe in plan):

        @functools.wraps(fn)
        def fp8_modules_fn(*args: Any, **kwargs: Any) -> R:
            return run(None, *args, **kwargs)

        return fp8_modules_fn

    @functools.wraps(fn)
    def delayed_fp8_modules_fn(params: Any, scales: Fp8Scales, *args: Any, **kwargs: Any) -> R:
        return run(_check_scales(scales, plan), params, *args, **kwargs)

    delayed = {name: recipe for name, _, recipe in plan if isinstance(recipe, DelayedScaling)}
    setattr(delayed_fp8_modules_fn, TAKES_FP8_SCALES, delayed)
    return delayed_fp8_modules_fn
