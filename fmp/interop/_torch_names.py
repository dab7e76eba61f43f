"""Parameter names shared by torch.optim's state_dicts and fmp's states: wrapper prefixes taken off."""

from __future__ import annotations

__all__ = ["unwrapped", "wrapper_depth"]

# Prefixes that wrappers add to parameter names: DDP's and FSDP's "module.", torch.compile's "_orig_mod.".
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def wrapper_depth(torch_names: list[str], fmp_names: list[str]) -> int:
    """How many wrapper prefixes to take off all of torch's names, in every group, for them to name params.

    One prefix is taken off at a time, from all names at once, until they all name params: a model
    whose own submodule is called "module" keeps that part of its names. 0 where they already
    name params, or where no depth makes them name distinct ones (the mismatch is reported then).
    """
    known, names, depth = set(fmp_names), torch_names, 0
    while not all(name in known for name in names) and all(name.startswith(_WRAPPER_PREFIXES) for name in names):
        names, depth = [name.split(".", 1)[1] for name in names], depth + 1
    return depth if all(name in known for name in names) and len(set(names)) == len(names) else 0


def unwrapped(name: str, depth: int) -> str:
    """`name` without its first `depth` components (the wrapper prefixes `wrapper_depth` counted)."""
    return name.split(".", depth)[depth] if depth else name
