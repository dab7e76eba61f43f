"""Failing fast when training has stalled: every recent step skipped, the loss scale at its floor.

The step itself never raises on values (that would need a host sync); `raise_if_stalled` reads the
counts the step keeps, where the caller logs, and says why the steps were skipped.
"""

from __future__ import annotations

import torch

import fmp._pytree as pytree
from fmp._checks import check_int
from fmp._loss_scale import DynamicLossScale
from fmp._scaler import loss_scales
from fmp._scaler import per_loss
from fmp._state import TrainState

__all__ = ["LossScaleStalledError", "raise_if_stalled"]


class LossScaleStalledError(FloatingPointError):
    """Raised by `raise_if_stalled`: steps keep overflowing at the minimum loss scale."""


def raise_if_stalled(state: TrainState, patience: int) -> None:
    """Fails fast when training has stalled: the last `patience` optimizer steps were all skipped for good.

    Opt-in, as DeepSpeed's error at `min_loss_scale`: once the scale cannot back off further,
    skipped steps mean gradients that are non-finite at any scale (NaN or inf in the data, the
    labels or the model), and a run that goes on skips every step in silence. Steps that ran with
    a loss scale out of range (`counts.bad_scale`) or whose update was non-finite from finite
    gradients (`counts.bad_update`) count too, and the message says which. Call this where you
    log; the step itself never raises on values, which would need a host sync.

    Note: syncs with the host, to read `state.counts.stalled`.

    Args:
        state: The training state (a vmapped ensemble's stacked state too: any member stalls it).
        patience: How many consecutive stalled steps are tolerated, >= 1.

    Raises:
        LossScaleStalledError: If `state.counts.stalled >= patience`, with the scale and the causes
            in the message.
        TypeError, ValueError: If `state` is not a TrainState or `patience` is not a positive int.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an fmp.TrainState, got {type(state).__name__}")
    patience = check_int("patience", patience, 1, torch.iinfo(torch.int64).max)
    stalled = state.counts.stalled
    worst = int(stalled.max())
    if worst < patience:
        return
    where = f" (ensemble members {stalled.ge(patience).nonzero().flatten().tolist()})" if stalled.dim() else ""
    scales = pytree.tree_map(lambda t: t.tolist(), loss_scales(state.scaler, stalled.device))
    bad_scale, bad_update = int(state.counts.bad_scale.max()), int(state.counts.bad_update.max())
    causes = []
    if bad_scale:
        causes.append(
            f"{bad_scale} of them ran with a loss scale that was itself out of range (NaN, inf, 0, negative or "
            f"outside [min_scale, max_scale]), which the step put back in range (now {scales}): the scaler state "
            f"was corrupted or built with the raw constructor; build it with DynamicLossScale.create(...) "
            f"(TrainState.create checks it) or load a sound checkpoint"
        )
    if bad_update:
        causes.append(
            f"{bad_update} of them had finite gradients but a non-finite update (new params or optimizer state): "
            f"the optimizer state or the params hold inf or NaN (check fmp.all_finite(state.opt_state)), or the "
            f"update overflows the param dtype; restore a checkpoint, or lower the lr"
        )
    if worst > bad_scale + bad_update or not causes:
        dynamic = any(isinstance(s, DynamicLossScale) for s in per_loss(state.scaler))
        remedy = "lower min_scale" if dynamic else "use a lower fixed scale or a DynamicLossScale"
        causes.insert(
            0,
            f"their gradients overflowed with the loss scale at its minimum ({scales}), so backing off cannot help. "
            f"Look for inf or NaN in the inputs, the labels or the model (a log of 0, a division by 0, an exploding "
            f"activation), or {remedy}. fmp.debug.locate_nonfinite(loss_fn, state.params, *batch, policy=policy, "
            f"scaler=state.scaler) names the first op and module to make inf or NaN",
        )
    raise LossScaleStalledError(f"the last {worst} optimizer steps{where} were all skipped: {'; '.join(causes)}")
