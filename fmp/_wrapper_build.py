"""An Inductor pass that has a large graph's C++ wrapper built apart from its kernels, at -O1.

On a machine without an accelerator `fmp.compile` has Inductor generate the graph's wrapper (buffer
allocation, kernel calls) as C++, by default in one file with the kernels, built at -O3. A whole
step's wrapper grows with the params (each param tensor's update has its buffers and kernel
arguments), and at -O3 its one long function takes more of the build than the kernels do: on the
zoo's 12-layer GPT-2 (148 param tensors), on a 2-core Xeon VM, the cold first call took about 250 s
built together and 130-140 s with the wrapper apart (`cpp_wrapper_build_separate`), its steps as
fast or up to 2% slower. On small graphs the build apart saves a few seconds and a step can lose a
few percent (the zoo's ResNet), so only graphs past a size build apart.

The choice is made per graph, from its size after the other post-grad passes, by setting
Inductor's config while that graph compiles. That setting outlives the compile unless the key is
among the options Inductor's config is patched with for it, as `fmp.compile` puts it: so the pass
is fmp.compile's own, not exported for `torch.compile` (where it would leave the setting behind).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass
from torch._inductor.custom_graph_pass import get_hash_for_files

__all__ = ["BuildLargeWrapperApart"]

# Calls in the post-grad graph above which the wrapper is built apart. Measured with torch 2.13 on
# a 2-core Xeon VM: the zoo's ResNet (1109 calls) stepped 2-7% slower built apart, its 2-layer GPT-2
# (1246) as fast; the 8-layer Llama (4058) and 12-layer GPT-2 (5966) within 2%, their cold
# compiles a quarter and a half shorter (benchmarks/RESULTS.md).
LARGE_GRAPH_CALLS = 4000


class BuildLargeWrapperApart(CustomInferenceAwareGraphPass):
    """Inductor post-grad pass: a graph of more than `calls` calls builds its C++ wrapper apart, at -O1.

    Acts on inference graphs only: a whole step is one, and only whole steps were measured; a
    training graph's forward and backward (a model's) keep the build `torch.compile(model)` gets.
    The graph itself is left unchanged.

    Args:
        calls: The number of `call_function` nodes above which the wrapper is built apart.
    """

    def __init__(self, calls: int = LARGE_GRAPH_CALLS) -> None:
        self.calls = calls

    # torch's inference-aware interface adds `is_inference` to its base class's signature.
    def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:  # type: ignore[override]
        """Sets Inductor's `cpp_wrapper_build_separate` for the graph being compiled by its size."""
        if not is_inference:
            return
        size = sum(1 for node in graph.nodes if node.op == "call_function")
        torch._inductor.config.cpp_wrapper_build_separate = size > self.calls

    def uuid(self) -> bytes:
        """Inductor's cache key for this pass: a hash of this file and the threshold."""
        return get_hash_for_files((__file__,)) + str(self.calls).encode()
