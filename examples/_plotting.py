"""What the examples' plots share: matplotlib if installed, the loss-scale panel on a base-2 axis, saving."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot(path: Path) -> Any:
    """matplotlib.pyplot without a display, or None (having said so) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot saved to {path} (pip install matplotlib)")
        return None
    return plt


def plot_scale(axes: Any, scales: Sequence[float], applied: Sequence[bool]) -> None:
    """The loss scale per step on a base-2 axis (scales are powers of two), skipped steps marked."""
    steps = range(1, len(scales) + 1)
    skipped = [s for s, ok in zip(steps, applied, strict=True) if not ok]
    axes.plot(steps, scales, drawstyle="steps-post")
    axes.set_yscale("log", base=2)
    if skipped:
        axes.plot(skipped, [scales[s - 1] for s in skipped], "rx", label="skipped step")
        axes.legend()
    axes.set_ylabel("loss scale")
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)


def save(plt: Any, figure: Any, path: Path) -> None:
    """Saves and closes `figure`."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"plot saved to {path}")


def scale_text(scale: float) -> str:
    """A loss scale and its power of two, e.g. "65536 = 2^16"."""
    return f"{scale:.10g} = 2^{math.log2(scale):.4g}"
