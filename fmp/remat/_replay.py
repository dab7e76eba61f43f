"""The ambient state a rematerialized call's recompute replays: what its first run saw around it.

A backward pass runs after the code around the forward has moved on: fmp's autocast region has
been left, `torch.autocast` may be off, the random generators have advanced and
`fmp.autocast.module_policies` has taken its forwards off the modules. `Ambient.capture()` records each at
the call, and `Ambient.replayed()` puts them back for the recompute and restores the present after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fmp.autocast._module_policy import patched_again
from fmp.autocast._module_policy import patched_modules
from fmp.autocast._transform import AutocastMode
from fmp.autocast._transform import NativeRegion
from fmp.autocast._transform import active_modes

__all__ = ["Ambient"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_FORWARD = "forward"


class Ambient:
    """The state around one call: fmp region, torch.autocast, generators, patched module forwards.

    Args:
        devices: The devices of the call's tensors; their torch.autocast state and generators are kept.
        rng: Whether to keep the generators' states: the CPU's, each accelerator's in `devices`, and
            `generators`.
        modules: Modules whose instance-level `forward` (as `fmp.autocast.module_policies` patches it) is kept,
            besides those the `module_policies` calls now running have patched.
        generators: `torch.Generator`s the call was given, which its random ops may draw from.
    """

    def __init__(
        self,
        devices: Iterable[torch.device],
        rng: bool,
        modules: Iterable[nn.Module],
        generators: Iterable[torch.Generator] = (),
    ) -> None:
        devices = set(devices)
        region = active_modes()[-1] if active_modes() else None
        # Inside a torch.autocast region entered within the fmp one, torch's state governs (replayed below).
        own = isinstance(region, AutocastMode | NativeRegion) and not region.inside_torch_autocast()
        self.region = region if own else None
        kinds = sorted({d.type for d in devices} | {"cpu"})
        self.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in kinds
            if kind in _AUTOCAST_DEVICE_TYPES
        ]
        self.rng_devices = sorted((d for d in devices if d.type != "cpu"), key=str) if rng else []
        self.rng_states = self._rng_snapshot() if rng else []
        self.generators = [(generator, generator.get_state()) for generator in generators] if rng else []
        kept = {id(module): module for module in [*modules, *patched_modules()]}
        self.forwards = [(module.__dict__, module.__dict__.get(_FORWARD)) for module in kept.values()]
        self.patched = patched_modules()

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls `fn` inside the recorded fmp autocast region, if there was one."""
        if self.region is None:
            return fn(*args, **kwargs)
        return self.region.run(fn, *args, **kwargs)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Puts the recorded state back for the body; the generators and forwards are restored after."""
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            if self.rng_states:
                # The generators go back to where they were, so the recompute draws nothing from them.
                stack.callback(self._set_rng, self._rng_snapshot())
                self._set_rng(self.rng_states)
            for generator, state in self.generators:
                stack.callback(generator.set_state, generator.get_state())
                generator.set_state(state)
            for attrs, forward in self.forwards:
                stack.callback(_set_forward, attrs, attrs.get(_FORWARD))
                _set_forward(attrs, forward)
            stack.enter_context(patched_again(self.patched))
            yield

    def _rng_snapshot(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()] + [torch.get_device_module(d.type).get_rng_state(d) for d in self.rng_devices]

    def _set_rng(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        for device, state in zip(self.rng_devices, states[1:], strict=True):
            torch.get_device_module(device.type).set_rng_state(state, device)


def _set_forward(attrs: dict[str, Any], forward: Any) -> None:
    # Through the instance __dict__, as module_policies patches it: None means the class's forward.
    if forward is None:
        attrs.pop(_FORWARD, None)
    else:
        attrs[_FORWARD] = forward
