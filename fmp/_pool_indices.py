"""An Inductor pass that keeps max pooling's argmax, which a whole-step graph would compute twice.

Inductor lowers max pooling (`max_pool1d/2d/3d`, `adaptive_max_pool2d` where the windows are
even) as `_low_memory_max_pool_with_offsets`: values and the window argmax as int8 offsets, each
an unrolled loop over the window, left unwritten until something forces them into a buffer.
When `torch.compile(model)` compiles the forward and backward passes as two graphs, the forward
saves the offsets for the backward, which writes them once. A step compiled whole
(`fmp.train_step`) is one graph: nothing forces the offsets, so the backward's scatter kernel
computes each window's argmax again from the pooling's input, a second pass over it. This pass
makes the offsets' producer write them: the same values, read back from memory.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.custom_graph_pass import get_hash_for_files

__all__ = ["RealizePoolIndices"]


class RealizePoolIndices(CustomGraphPass):
    """Inductor post-grad pass: max pooling's argmax offsets are written to a buffer, not recomputed.

    Each read of `prims._low_memory_max_pool_with_offsets`'s offsets goes through
    `prims.inductor_force_stride_order` with the offsets' own strides, which Inductor lowers by
    storing them in a buffer of that stride order. Values and the graph's outputs are unchanged.
    Pooling that Inductor does not lower this way (windows of more than 25 elements, fractional
    pooling, uneven adaptive windows) already keeps its indices in memory. Offsets whose strides
    are symbolic (spatial sizes compiled as dynamic) are left as they are.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Routes the readers of each pooling's offsets through a realized copy; modifies `graph`."""
        pool = torch.ops.prims._low_memory_max_pool_with_offsets.default
        force = torch.ops.prims.inductor_force_stride_order.default
        order = {node: index for index, node in enumerate(graph.nodes)}
        for node in list(order):
            is_offsets = (
                node.op == "call_function"
                and node.target is operator.getitem
                and node.args[1] == 1
                and getattr(node.args[0], "target", None) is pool
            )
            if not is_offsets or "val" not in node.meta:
                continue
            if all(reader.target is force for reader in node.users):  # unread, or realized by a run before
                continue
            stride = node.meta["val"].stride()
            if not all(isinstance(each, int) for each in stride):
                # Dynamic spatial sizes: left as Inductor lowers them (a dynamic batch keeps
                # integer strides and is realized).
                continue
            readers = sorted(node.users, key=order.__getitem__)
            with graph.inserting_before(readers[0]):
                realized = graph.call_function(force, (node, list(stride)))
            realized.meta.update(node.meta)
            for reader in readers:
                reader.replace_input_with(node, realized)

    def uuid(self) -> bytes:
        """Inductor's cache key for this pass: a hash of this file."""
        return get_hash_for_files((__file__,))
