"""An Inductor pass that keeps max pooling's argmax, which a whole-step graph would recompute.

Inductor computes max pooling's window argmax (the offsets that become the indices) as an
unrolled loop over the window, left unwritten until something forces it into a buffer. When
`torch.compile(model)` compiles the forward and backward passes as two graphs, the forward saves
the offsets for the backward, which writes them once. A step compiled whole (`fmp.train_step`)
is one graph: nothing forces them, so the backward kernel recomputes each window's argmax for
every gradient element that reads it, several loads and compares where one load would do. This
pass makes the indices' producer write its result: the same values, read back from memory.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.custom_graph_pass import get_hash_for_files

__all__ = ["RealizePoolIndices"]


def _ops_returning_indices() -> frozenset[Any]:
    """Ops whose second output is a pooling window's argmax (offsets or flat indices)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    return frozenset(
        {
            prims._low_memory_max_pool_with_offsets.default,
            aten.max_pool2d_with_indices.default,
            aten.max_pool3d_with_indices.default,
            aten.adaptive_max_pool2d.default,
            aten.adaptive_max_pool3d.default,
        }
    )


class RealizePoolIndices(CustomGraphPass):
    """Inductor post-grad pass: every max pooling's indices are written to a buffer, not recomputed.

    Each read of a pooling's second output goes through `prims.inductor_force_stride_order` with
    the output's own strides, which Inductor lowers by storing the value in a buffer of that
    layout. Values and the graph's outputs are unchanged.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Routes the readers of each pooling's indices through a realized copy; modifies `graph`."""
        pools = _ops_returning_indices()
        force = torch.ops.prims.inductor_force_stride_order.default
        for node in list(graph.nodes):
            is_indices = (
                node.op == "call_function"
                and node.target is operator.getitem
                and node.args[1] == 1
                and getattr(node.args[0], "target", None) in pools
            )
            already = all(user.target is force for user in node.users)  # a second run changes nothing
            if not is_indices or already or "val" not in node.meta:
                continue
            readers = list(node.users)
            with graph.inserting_after(node):
                realized = graph.call_function(force, (node, list(node.meta["val"].stride())))
            realized.meta.update(node.meta)
            for reader in readers:
                reader.replace_input_with(node, realized)

    def uuid(self) -> bytes:
        """Inductor's cache key for this pass: a hash of this file."""
        return get_hash_for_files((__file__,))
