"""How `train_step` threads FP8 delayed-scaling states: differentiated beside the params, updated after.

With `TrainState.fp8` holding a `DelayedScalingState` per FP8 linear layer, the step hands the
loss function (made by `fmp.fp8.fp8_modules` with a delayed recipe) an `Fp8Scales` and
differentiates with respect to the params and the scales together: the scales' gradients are the
step's amaxes (the layers' `fp8_linear` returns them so), which the step's unscale brings to the
unscaled gradient's and its finite check covers. The optimizer sees the params' gradients alone;
each state records its amaxes (`DelayedScalingState.update`), and a skipped step keeps the states
as they were, as it keeps the params. With gradient accumulation each micro-batch records its
amaxes and the window's step advances the states once, over their maximum. With several losses
each loss's pass quantizes by its own loss scale, and the states record the passes' largest amaxes
(`fmp._grad.differentiate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fmp._pytree as pytree
from fmp._delayed_scaling import DelayedScaling
from fmp._delayed_scaling import DelayedScalingState
from fmp._delayed_scaling import Fp8Scales
from fmp._delayed_scaling import check_fp8_state_shapes
from fmp._delayed_scaling import is_delayed_state
from fmp._policy import Policy
from fmp._tree import select_tree

__all__ = [
    "TAKES_FP8_SCALES",
    "advance_fp8",
    "check_fp8_step",
    "check_reduced_amaxes",
    "has_fp8_states",
    "with_fp8_scales",
]

TAKES_FP8_SCALES = "_fmp_takes_fp8_scales"
"""The attribute `fmp.fp8.fp8_modules` sets on a loss function that takes `Fp8Scales` after the params:
its delayed recipes by layer name, which the states must have been made from."""


def has_fp8_states(fp8: Any) -> bool:
    """Whether `TrainState.fp8` holds any state (`()`, the default, holds none)."""
    return bool(pytree.tree_leaves(fp8))


def check_fp8_step(loss_fn: Callable[..., Any], fp8: Any, policy: Policy) -> None:
    """Raises where the loss function and `TrainState.fp8` disagree, or the policy would cast the scales.

    Static checks only (no host sync): each state's shapes, its settings against the recipe its
    layer runs on (`fp8_modules`), and no state for a layer that has none.
    """
    recipes = getattr(loss_fn, TAKES_FP8_SCALES, None)
    takes_scales = bool(recipes)
    has_states = has_fp8_states(fp8)
    if not has_states:
        if takes_scales:
            raise TypeError(
                "loss_fn runs layers with delayed FP8 scaling but state.fp8 holds no state for them: create the "
                "state with fmp.TrainState.create(..., fp8=fmp.fp8.init_states(model, recipes))"
            )
        return
    if not takes_scales:
        raise TypeError(
            "state.fp8 holds delayed-scaling states but loss_fn does not take them: transform it with "
            "fmp.fp8.fp8_modules(loss_fn, model, recipes), the recipes state.fp8 was made from"
        )
    check_fp8_state_shapes(fp8)
    if isinstance(recipes, dict) and isinstance(fp8, dict):
        _check_against_recipes(fp8, recipes)
    if not policy.casts_by_op and policy.compute_dtype != torch.float32:
        raise ValueError(
            f"train_step cannot thread delayed FP8 states (state.fp8) with a policy that casts params whole to "
            f"{policy.compute_dtype} (rules=None): it would cast the float32 scales too; use the op rules (the default)"
        )


def _check_against_recipes(fp8: dict[str, Any], recipes: dict[str, DelayedScaling]) -> None:
    extra = sorted(set(fp8) - set(recipes))
    if extra:
        raise ValueError(
            f"state.fp8 holds states for {extra}, which loss_fn runs on no delayed recipe: make state.fp8 with "
            f"fmp.fp8.init_states(model, recipes), the model and recipes given to fp8_modules"
        )
    for name, recipe in recipes.items():
        state = fp8.get(name)
        if not isinstance(state, DelayedScalingState):
            continue  # fp8_modules names a missing state itself
        settings = {
            "history_len": (int(state.amax_history.shape[0]), recipe.history_len),
            "amax_compute": (state.amax_compute, recipe.amax_compute),
            "margin": (state.margin, recipe.margin),
            "format": (state.format, recipe.format),
        }
        for setting, (held, given) in settings.items():
            if held != given:
                raise ValueError(
                    f"state.fp8[{name!r}] was made with {setting}={held!r}, but loss_fn runs the layer on "
                    f"{setting}={given!r}: make state.fp8 with fmp.fp8.init_states(model, recipes), the recipes "
                    f"given to fp8_modules"
                )


def with_fp8_scales(loss_fn: Callable[..., Any], params: Any, fp8: Any) -> tuple[Callable[..., Any], Any]:
    """`loss_fn` over `(params, scales)`, handing it `Fp8Scales` after the params; and that pair.

    Args:
        loss_fn: Takes `(params, Fp8Scales, *rest)`.
        params: The params.
        fp8: `TrainState.fp8`.

    Returns:
        `(fn, (params, scales))`: `fn((params, scales), *rest, loss_scale)` calls `loss_fn`, as
        `differentiate` with `fp8_scales` calls it, with each loss's pass's scale.
    """
    scales = pytree.tree_map(lambda s: s.scale, fp8, is_leaf=is_delayed_state)

    def with_scales(params_and_scales: tuple[Any, Any], *rest: Any) -> Any:
        params, scales = params_and_scales
        *args, loss_scale = rest
        return loss_fn(params, Fp8Scales(scales, loss_scale), *args)

    return with_scales, (params, scales)


def check_reduced_amaxes(amaxes: Any, fp8: Any) -> None:
    """Raises unless `reduce_grads` gave back one amax tensor of shape (3,) per state of `fp8`."""
    states = pytree.tree_leaves(fp8, is_leaf=is_delayed_state)
    leaves = pytree.tree_leaves(amaxes)
    if len(leaves) != len(states) or any(not isinstance(a, torch.Tensor) or a.shape != (3,) for a in leaves):
        raise TypeError(
            f"reduce_grads must keep Gradients.amaxes, the step's FP8 amaxes (one tensor of shape (3,) per state "
            f"of state.fp8, {len(states)} here): return gradients._replace(...) with them, reduced (maximum)"
        )


def advance_fp8(fp8: Any, amaxes: Any, applied: torch.Tensor, stepped: torch.Tensor | None) -> Any:
    """Each state with its amaxes recorded, advanced where the step applied, kept where it skipped.

    With accumulation (`stepped` not None) a call that ends no window only records (row 0 keeps
    the window's maximum so far), and a skipped window clears row 0 again: the state it started from.
    """
    states, spec = pytree.tree_flatten(fp8, is_leaf=is_delayed_state)
    recorded = [state.record(amax) for state, amax in zip(states, pytree.tree_leaves(amaxes), strict=True)]
    advanced = pytree.tree_unflatten([state.advance() for state in recorded], spec)
    if stepped is None:
        return select_tree(applied, advanced, fp8)
    started = pytree.tree_unflatten([state.cleared() for state in recorded], spec)
    ended = select_tree(applied, advanced, started)
    return select_tree(stepped, ended, pytree.tree_unflatten(recorded, spec))
