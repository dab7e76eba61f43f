"""Bridges to code written for `torch.nn` and `torch.optim`.

`GradientBuffer` keeps a module's `.grad`s in a few flat buffers and unscales them in one pass, for
a `loss.backward()` loop with a torch optimizer; `to_torch_state_dict` and `from_torch_state_dict`
convert optimizer state between fmp's pure optimizers and `torch.optim`'s `state_dict`.
"""

from fmp.interop._from_torch import from_torch_state_dict
from fmp.interop._gradient_buffer import GradientBuffer
from fmp.interop._to_torch import to_torch_state_dict

__all__ = ["GradientBuffer", "from_torch_state_dict", "to_torch_state_dict"]
