"""Activation checkpointing (rematerialization) that works under torch.func, torch.compile and autograd.

`remat(fn)` keeps only `fn`'s inputs and outputs for the backward pass and runs `fn` again there,
replaying the autocast regions, module policies and random state of the forward pass.
"""

from fmp.remat._remat import remat

__all__ = ["remat"]
