"""Debugging tools: find where a step's inf or NaN comes from.

`locate_nonfinite` reruns a loss eagerly, op by op, and names the first op (forward or backward)
whose output is non-finite while its inputs are finite, with its module and dtypes. It syncs with
the host once per op: a tool for a skipped step, not for the training loop.
"""

from fmp.debug._locate import NonFiniteOrigin
from fmp.debug._locate import NonFiniteReport
from fmp.debug._locate import locate_nonfinite

__all__ = ["NonFiniteOrigin", "NonFiniteReport", "locate_nonfinite"]
