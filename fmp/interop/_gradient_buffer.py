"""Contiguous gradient storage for autograd users: each parameter's `.grad` a view into one flat buffer.

`loss.backward()` gives each parameter a gradient tensor of its own, so an unscale runs once per
gradient: hundreds of small gradients cost hundreds of loops (or launches), plus the compiled
wrapper's bookkeeping for every one of them. `GradientBuffer.attach(params)` allocates one flat
buffer per dtype and makes each parameter's `.grad` a view into it. Backward accumulates into those
views in place, optimizers read them as ordinary gradients, `unscale_` unscales and checks all of
them in one compiled pass over one tensor per buffer, writing in place, and `step` has a fused
torch optimizer skip an overflowed step on the device.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TypeVar

import torch

from fmp._checks import check_bool
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._scale_checks import check_scaler
from fmp._scaler import compiled_unscale_and_adjust
from fmp._scaler import unscale_and_adjust
from fmp._tree import _ROW_LENGTH
from fmp._tree import check_finite_flag
from fmp.interop._accumulation import Accumulation
from fmp.interop._buffer_layout import check_param
from fmp.interop._buffer_layout import check_skips_on_device
from fmp.interop._buffer_layout import describe
from fmp.interop._buffer_layout import name_and_param
from fmp.interop._buffer_layout import padded
from fmp.interop._buffer_layout import view_like

__all__ = ["GradientBuffer"]

# Each view starts on a 64-byte boundary, so that vectorized kernels (multi-tensor optimizers on
# GPUs among them) see aligned gradients. The padding between views stays zero: backward never
# writes it, and zero is finite and unscales to zero.
_ALIGNMENT_BYTES = 64

ScaleT = TypeVar("ScaleT", bound=LossScale)


# The buffer each parameter's gradient lives in, for a step that another buffer's parameters share:
# id(param) -> (param, buffer), both held weakly (a tensor cannot key a WeakKeyDictionary: its == is elementwise).
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradientBuffer]]] = {}


def _owner(param: torch.Tensor) -> GradientBuffer | None:
    entry = _OWNERS.get(id(param))
    return entry[1]() if entry is not None and entry[0]() is param else None


class GradientBuffer:
    """The gradients of a list of parameters, kept in one flat buffer per dtype.

    A host-side handle, like a `torch.optim.Optimizer`: it refers to the parameters and is not a
    pytree. Build it with `attach`. Every parameter then has a gradient (zeros until a backward
    writes it), as with DDP's `gradient_as_bucket_view`: one that no loss reaches keeps a zero
    gradient where it would otherwise have none, which optimizers with weight decay or momentum
    act on. Move or cast the model before attaching: `.to()` or `.half()` afterwards gives the
    parameters new gradients outside the buffer (`flat` then raises).

    Example:
        ```python
        grads = fmp.interop.GradientBuffer.attach(model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for x, y in data:
            # not scaler.scale(loss).backward(): unscale_ refuses gradients of a loss the buffer did not scale
            grads.scale(loss_fn(model(x), y), scaler).backward()
            grads_finite, scaler = grads.unscale_(scaler)
            grads.step(optimizer, grads_finite)  # skipped on the device when not finite
            grads.zero_()
        ```
    """

    def __init__(
        self,
        params: tuple[torch.Tensor, ...],
        names: tuple[str | None, ...],
        views: tuple[torch.Tensor, ...],
        buffers: tuple[torch.Tensor, ...],
        compiled: bool,
    ) -> None:
        """Wraps what `attach` built; call `attach` instead."""
        self._params = params
        self._names = names
        self._param_ids = frozenset(id(param) for param in params)
        self._views = views
        self._buffers = buffers
        self._compiled = compiled
        self._view_pointers = tuple(view.data_ptr() for view in views)
        self._accumulation = Accumulation(params)
        owner = weakref.ref(self)
        for param in params:
            if id(param) not in _OWNERS:  # the entry goes with the param
                weakref.finalize(param, _OWNERS.pop, id(param), None)
            _OWNERS[id(param)] = (weakref.ref(param), owner)

    @classmethod
    def attach(
        cls,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        compiled: bool = True,
    ) -> GradientBuffer:
        """Allocates the buffers and makes each parameter's `.grad` a view into them.

        Parameters are grouped by dtype, one buffer per group in order of first appearance, and
        laid out in the order given. A gradient a parameter already has is copied into its view,
        so nothing accumulated so far is lost. Every entry is checked before any `.grad` changes.

        Args:
            params: Leaf tensors on one device that require grad, each listed once (e.g.
                `model.parameters()`), or `(name, tensor)` pairs (`model.named_parameters()`, or a
                dict of them), whose names the errors then give.
            compiled: Whether `unscale_` and `unscale_and_clip_` run `torch.compile`d (a C++
                compiler on CPU, seconds of compiling on first use, one pass per buffer) or
                eagerly (`unscale_and_adjust`: no compiler, several passes). `unscale_` gives the
                same bits either way; `unscale_and_clip_`'s norm sums in another order compiled,
                so the norm and the clipped gradients may differ in the last float32 bit.

        Returns:
            The buffer handle.

        Raises:
            TypeError: If an entry is not a tensor, or is a tensor subclass (such as a DTensor),
                or `compiled` is not a bool.
            ValueError: If `params` is empty or spans several devices, or an entry is sparse or has
                a sparse gradient, does not require grad, is not a leaf, or is listed twice.
        """
        check_bool("compiled", compiled)
        first_index: dict[int, int] = {}
        # A dict by name (dict(model.named_parameters())) iterates over its keys: take its items.
        named = [name_and_param(entry) for entry in (params.items() if isinstance(params, Mapping) else params)]
        checked = [check_param(i, p, name, first_index) for i, (name, p) in enumerate(named)]
        names = tuple(name for name, _ in named)
        if not checked:
            raise ValueError("params is empty: there are no gradients to keep in a buffer")
        devices = list(dict.fromkeys(str(param.device) for param in checked))
        if len(devices) > 1:
            raise ValueError(f"params span {', '.join(devices)}: attach one GradientBuffer per device")
        groups: dict[torch.dtype, list[int]] = {}
        for i, param in enumerate(checked):
            groups.setdefault(param.dtype, []).append(i)
        views: dict[int, torch.Tensor] = {}
        buffers = []
        with torch.no_grad():  # copying a gradient in must not record autograd history
            for dtype, members in groups.items():
                alignment = max(1, _ALIGNMENT_BYTES // checked[members[0]].element_size())
                lengths = [padded(checked[i].numel(), alignment) for i in members]
                # A whole number of rows, so a compiled GPU finite check reads the buffer row by
                # row in the pass that unscales it (see fmp._tree.all_finite).
                buffer = torch.zeros(padded(sum(lengths), _ROW_LENGTH), device=checked[0].device, dtype=dtype)
                offsets = itertools.accumulate(lengths, initial=0)
                for i, offset in zip(members, offsets, strict=False):  # one offset more than members
                    view = view_like(buffer, offset, checked[i])
                    existing = checked[i].grad
                    if existing is not None:
                        view.copy_(existing)
                    checked[i].grad = view
                    views[i] = view
                buffers.append(buffer)
        return cls(tuple(checked), names, tuple(views[i] for i in range(len(checked))), tuple(buffers), compiled)

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The buffers, one 1-D tensor per dtype, after checking each `.grad` is still its view.

        Returns:
            The flat buffers, in order of each group's first parameter. Writing to them writes the
            parameters' gradients (that is what `unscale_` does).

        Raises:
            RuntimeError: If a parameter's `.grad` is no longer its view into the buffer: set to
                None (`optimizer.zero_grad()` does that by default), replaced (a backward after
                such a zero_grad, an assignment, or a backward with `create_graph=True`), or moved
                to new memory (the model moved or cast after `attach`).
        """
        for index, (param, view, pointer) in enumerate(
            zip(self._params, self._views, self._view_pointers, strict=True)
        ):
            if param.grad is view and view.data_ptr() == pointer:
                continue
            where = describe(index, param, self._names[index])
            if param.grad is None:
                raise RuntimeError(
                    f"{where} has .grad None, so its gradient is no longer in the buffer: zero gradients "
                    "with GradientBuffer.zero_() or optimizer.zero_grad(set_to_none=False), not set_to_none"
                )
            if param.grad is view:
                raise RuntimeError(
                    f"{where} has a .grad that no longer points into the buffer: the model was moved or cast "
                    "(.to(), .half()) after attach; attach a new GradientBuffer after moving it"
                )
            raise RuntimeError(
                f"{where} has a .grad that is not its view into the buffer: a backward after "
                "optimizer.zero_grad() (set_to_none) gave it a new one, or it was assigned, or a backward with "
                "create_graph=True accumulated out of place. zero_() re-attaches the views but discards "
                "the gradients they hold; zero with GradientBuffer.zero_() before each backward"
            )
        return self._buffers

    def scale(self, loss: torch.Tensor, scaler: LossScale) -> torch.Tensor:
        """`scaler.scale(loss)`, whose backward the buffer recognizes: the only backward `unscale_` accepts.

        `unscale_` and `unscale_and_clip_` raise if a backward that did not start at a loss this
        method returned accumulated into the gradients since the last `zero_()` or unscale:
        `loss.backward()`, the classic slip, whose gradients are not scaled and would be unscaled
        into a step the loss scale times too small, silently. `scaler.scale(loss).backward()` is
        refused too: `scaler.scale` is a pure function, so the buffer cannot see its result and
        cannot tell that backward from `loss.backward()`. With an `fmp.NoOpLossScale` nothing is
        scaled, and a plain `loss.backward()` is accepted.

        Only `.backward()` called on the returned tensor itself counts (the method is the tensor's
        own, set here): a backward that starts anywhere else is refused even where its graph holds
        the scaled loss, as in `(scaled + other_loss).backward()`, whose `other_loss` gradients are
        not scaled. So are `(scaled / n).backward()`, `torch.autograd.backward(scaled)` and a
        backward of several scaled losses at once: scale the loss you differentiate
        (`grads.scale(loss / n, scaler)`, `grads.scale(loss_a + loss_b, scaler)`). After an
        in-place edit of the returned tensor (`scaled /= n`, `scaled.add_(other)`,
        `scaled.detach_()`) its `.backward()` is torch's own, from the edited history, and is
        refused as well; one edited and dropped before its `.backward()` ran
        (`grads.scale(loss, scaler).add_(x).backward()`) raises there, as its backward cannot see
        the edit. Only `detach_()` on such a dropped temporary goes unseen (it changes no version):
        its backward runs from the loss as scaled. A backward that raised midway leaves no mark
        behind, and one nested in a scaled backward, on its thread (a reentrant checkpoint's),
        counts as scaled.

        Inside `torch.compile` the marking runs eagerly (`torch.compiler.disable`): a compiled
        forward that calls `scale` graph-breaks there (and `fullgraph=True` refuses it), and the
        tensor it returns keeps its `.backward`. Compiling the model alone and calling `scale`
        outside it avoids the break.

        Args:
            loss: The loss (or any tensor to call `backward` on), with autograd history.
            scaler: The loss-scale state, the one `unscale_` will get.

        Returns:
            The scaled loss, as `scaler.scale(loss)`: call `.backward()` on it.

        Raises:
            TypeError: If `loss` is not a tensor, or is a tensor subclass, or `scaler` is not an
                fmp loss-scale state.
            ValueError: If `loss` has no autograd history (made under `torch.no_grad()`, or from
                tensors that do not require grad), so that its backward would write no gradient.
            RuntimeError: From the returned tensor's `.backward()`, if that tensor was edited in
                place and dropped before the call, as in `grads.scale(loss, scaler).add_(x).backward()`.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
        check_scaler(scaler)
        scaled: torch.Tensor = self._checked_and_marked(loss, scaler.scale(loss), scaler)
        return scaled

    # Run eagerly, also inside a compiled function: Dynamo cannot read a grad_fn, hook an autograd
    # node nor set an entry of a tensor's __dict__ (it raised on that), so a compiled forward
    # graph-breaks here, once, and the tensor it returns keeps its `.backward`.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _checked_and_marked(self, loss: torch.Tensor, scaled: torch.Tensor, scaler: LossScale) -> torch.Tensor:
        """`scaled`, `scaler.scale(loss)`, once checked and given its `.backward` (see `scale`)."""
        if scaled.grad_fn is None:
            raise ValueError(
                "loss has no autograd history (computed under torch.no_grad(), or from tensors that do not "
                "require grad), so its backward would write no gradient; compute it with grad enabled"
            )
        if type(scaled) is not torch.Tensor:
            raise TypeError(
                f"loss is a {type(scaled).__name__}: the buffer marks the backward of plain tensors only, "
                "as it holds plain tensors' gradients only"
            )
        if scaled is not loss:  # nothing to mark where nothing was scaled (NoOpLossScale)
            self._accumulation.watch(scaled)
            self._accumulation.note_scale(getattr(scaler, "loss_scale", None))
        return scaled

    def zero_(self) -> None:
        """Zeros every gradient, one fill per buffer, and re-attaches any `.grad` set to None or replaced."""
        for buffer in self._buffers:
            buffer.zero_()
        self._accumulation.zeroed()
        for param, view in zip(self._params, self._views, strict=True):
            if param.grad is not view:
                param.grad = view

    def unscale_(self, scaler: ScaleT) -> tuple[torch.Tensor, ScaleT]:
        """Unscales every gradient in place, checks them and moves the scale: GradScaler's `unscale_` + `update`.

        One `fmp.unscale_and_adjust(scaler, self.flat(), donate=True)`, compiled: a pass over each
        buffer that writes the unscaled values back and checks them (the unscaled values, unlike
        GradScaler's kernel). Where the compiled function falls back to eager (past Dynamo's
        recompile limit, with a warning), the eager function unscales the buffers in place, so
        the gradients are unscaled in place either way.

        Args:
            scaler: The loss-scale state the gradients were computed with.

        Returns:
            `(grads_finite, new_scaler)`: a 0-dim bool tensor, True when every gradient is finite
            (on the device: nothing is read on the host), and the adjusted scaler state.

        Raises:
            RuntimeError: As `flat`, if a `.grad` is no longer its view; or if neither a backward
                nor `zero_()` has renewed the gradients since the last `unscale_` or
                `unscale_and_clip_` (they would be unscaled twice; an in-place edit such as
                `clip_grad_norm_` renews nothing, and gradients written by hand need a `zero_()`
                first); or if a backward accumulated into unscaled gradients with no `zero_()`
                between (they mix two scales); or if `scaler` is not the state `scale` multiplied
                the losses by since then (by identity), or `scale` got two; or, unless `scaler` is
                an `fmp.NoOpLossScale`, if a backward that did not start with `.backward()` on a
                loss `scale` returned (`loss.backward()`,
                `scaler.scale(loss).backward()`, which the buffer cannot see, or
                `(scaled + loss).backward()`) accumulated into them since the last `zero_()` or
                unscale: their values are not scaled.
            TypeError, ValueError: As `fmp.unscale_and_adjust`, for a wrong scaler or one on
                another device than the gradients.
        """
        buffers = self._unscalable_buffers(scaler)
        unscale = compiled_unscale_and_adjust if self._compiled else unscale_and_adjust
        unscaled, grads_finite, _, new_scaler = unscale(scaler, buffers, donate=True)
        self._write_back(buffers, unscaled)
        return grads_finite, new_scaler

    def unscale_and_clip_(self, scaler: ScaleT, max_norm: float) -> tuple[torch.Tensor, torch.Tensor, ScaleT]:
        """`unscale_`, then every gradient clipped to a global L2 norm of `max_norm`, in place.

        GradScaler's `unscale_`, `torch.nn.utils.clip_grad_norm_(params, max_norm)` and `update`
        as one `fmp.unscale_and_adjust(scaler, self.flat(), max_norm=max_norm, donate=True)`: each
        buffer is read twice and written once, where torch.amp reads and writes the gradients five
        times. The norm is taken over the buffers (the padding between views is zero, so it is
        the gradients' norm), in another order of sums than `clip_grad_norm_`'s.

        Args:
            scaler: The loss-scale state the gradients were computed with.
            max_norm: The largest global norm let through, > 0 (`inf` only measures the norm).

        Returns:
            `(grads_finite, grad_norm, new_scaler)`: the finite flag, the global norm of the
            unscaled gradients before clipping (0-dim, on the device) and the adjusted scaler.

        Raises:
            RuntimeError, TypeError, ValueError: As `unscale_`, or if `max_norm` is not a positive
                real number.
        """
        buffers = self._unscalable_buffers(scaler)
        unscale = compiled_unscale_and_adjust if self._compiled else unscale_and_adjust
        clipped, grads_finite, grad_norm, new_scaler = unscale(scaler, buffers, max_norm=max_norm, donate=True)
        self._write_back(buffers, clipped)
        assert grad_norm is not None  # for mypy: max_norm was given
        return grads_finite, grad_norm, new_scaler

    def _unscalable_buffers(self, scaler: LossScale) -> tuple[torch.Tensor, ...]:
        buffers = self.flat()
        if self._accumulation.onto_unscaled:
            raise RuntimeError(
                "a backward accumulated into gradients that unscale_ had already unscaled, with no zero_() between: "
                "they mix unscaled and scaled values, and no unscale can tell them apart; call grads.zero_() after "
                "each optimizer step (optimizer.zero_grad(set_to_none=False) zeros them unseen), then run the "
                "backward again"
            )
        if not self._accumulation.since_unscale:
            raise RuntimeError(
                "the gradients were already unscaled: no backward has accumulated into them since, nor has "
                "zero_() cleared them (an in-place edit such as clip_grad_norm_ or optimizer.zero_grad() counts "
                "as neither), so they would be unscaled twice; zero_() and run a backward (or write new "
                "gradients) first"
            )
        scaled_by = self._accumulation.scale
        if self._accumulation.scales_differ or (
            scaled_by is not None and getattr(scaler, "loss_scale", None) is not scaled_by
        ):
            raise RuntimeError(
                "unscale_ got another loss-scale state than scale() multiplied the losses by since the last zero_() "
                "or unscale, or scale() got two: the gradients would be divided by another scale; pass unscale_ "
                "the scaler you passed scale(), and scale() the one unscale_ returned last"
            )
        index = self._accumulation.unscaled_param
        # With no scaling (NoOpLossScale) a plain backward's gradients are the right ones.
        if index is not None and not isinstance(scaler, NoOpLossScale):
            check_scaler(scaler)  # a wrong scaler is named as such, not as an unscaled backward
            where = describe(index, self._params[index], self._names[index])
            raise RuntimeError(
                f"{where} received a gradient from a backward that did not start at a loss this buffer scaled: "
                "loss.backward() where grads.scale(loss, scaler).backward() belongs. Unscaling would divide that "
                "gradient by the loss scale and make the step that many times too small; zero_() the buffer and "
                "run the backward of grads.scale(loss, scaler) (scaler.scale(loss).backward() is refused too: "
                "scale is pure, so the buffer cannot see that loss). Only .backward() on the very tensor "
                "grads.scale returned counts, not the backward of a tensor computed from it ((scaled + loss), "
                "scaled / n), nor torch.autograd.backward(scaled), nor its own after an in-place edit (scaled /= n, "
                "scaled.add_(loss)): scale the loss you differentiate"
            )
        return buffers

    def _write_back(self, buffers: tuple[torch.Tensor, ...], results: tuple[torch.Tensor, ...]) -> None:
        # The results are the buffers (donated), compiled or eager, except where eager donation
        # writes nothing (fmp._donation.writes_in_place: under a torch.func transform, say).
        for buffer, values in zip(buffers, results, strict=True):
            if values.data_ptr() != buffer.data_ptr():
                buffer.copy_(values)
        self._accumulation.unscaled_now()

    def _check_owns(self, optimizer: torch.optim.Optimizer) -> None:
        """Raises if `optimizer` steps a parameter whose gradient no GradientBuffer holds (no `unscale_` saw it).

        A parameter without a gradient (a frozen one) is not stepped. One another buffer holds (one
        buffer per device, say) passes if that buffer was unscaled since its last backward.
        """
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None or id(param) in self._param_ids:
                    continue
                where = (
                    f"the optimizer steps param_groups[{group_index}]['params'][{index}] "
                    f"(shape {tuple(param.shape)}, {param.dtype})"
                )
                owner = _owner(param)
                if owner is None or not any(grad is view for view in owner._views):
                    raise ValueError(
                        f"{where}, whose gradient no GradientBuffer holds: unscale_ never unscaled it, so it would be "
                        "applied times the loss scale; attach a buffer to every parameter the optimizer steps"
                    )
                if owner._accumulation.accumulated:
                    raise ValueError(
                        f"{where}, whose GradientBuffer has not been unscaled since its last backward: its gradients "
                        "would be applied times the loss scale; call unscale_ on every buffer the optimizer steps"
                    )

    def step(self, optimizer: torch.optim.Optimizer, grads_finite: torch.Tensor) -> None:
        """Takes `optimizer`'s step, which leaves params and state unchanged where `grads_finite` is False.

        The decision stays on the device: the optimizer gets `found_inf = ~grads_finite`, as
        GradScaler hands it to optimizers whose fused kernels skip on the device (torch's Adam,
        AdamW, Adagrad and SGD without momentum, built with `fused=True`).

        Args:
            optimizer: A fused torch optimizer over (some of) this buffer's parameters.
            grads_finite: The 0-dim bool tensor `unscale_` returned.

        Raises:
            TypeError: If `optimizer` is not a torch optimizer that skips on the device (not fused,
                or fused SGD with momentum, whose first skipped step leaves its momentum
                uninitialized), or `grads_finite` is not a tensor.
            ValueError: If `grads_finite` is not a 0-dim bool tensor, or the optimizer steps a
                parameter whose gradient no buffer holds, or another buffer holds that has not
                been unscaled since its last backward.
        """
        check_skips_on_device(optimizer)
        check_finite_flag(grads_finite)
        self._check_owns(optimizer)
        optimizer.found_inf = (~grads_finite).float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
