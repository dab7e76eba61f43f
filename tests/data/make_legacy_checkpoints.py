"""Writes the legacy checkpoints in tests/data with the fmp of an earlier commit (run once, output committed).

    git archive b733f70 fmp | tar -x -C /tmp/fmp-b733f70
    python tests/data/make_legacy_checkpoints.py /tmp/fmp-b733f70 tests/data/b733f70-torch-save.pt

(likewise e53d265, and 9a0f3df with a third argument `fmp` to write through fmp.serialization.save).
b733f70 is the last commit before the layout by concern (names fmp.state.TrainState, 4 counts),
e53d265 the layout by concern (fmp._state.TrainState, 4 counts), 9a0f3df fmp.serialization
(fmp._state.TrainState, 6 counts).
"""

import sys

sys.path.insert(0, sys.argv[1])

import torch

import fmp


def legacy_states() -> dict[str, object]:
    """Small states of every saved class: the values tests/test_serialization.py expects back."""
    params = {"w": torch.arange(3.0), "b": torch.tensor([0.5])}
    adam = fmp.TrainState.create(
        dict(params), fmp.optim.adamw(1e-3), fmp.DynamicLossScale.create(), accumulation_steps=2
    )
    counts = adam.counts._replace(applied=torch.tensor(7), skipped=torch.tensor(2), stalled=torch.tensor(1))
    adam = adam._replace(counts=counts)
    sgd = fmp.TrainState.create(dict(params), fmp.optim.sgd(0.1, momentum=0.9), fmp.StaticLossScale.create(8.0))
    ema = fmp.optim.ema(fmp.optim.sgd(0.1), 0.9)
    rounding = fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1))
    return {
        "adam": adam,
        "sgd": sgd,
        "ema": ema.init(dict(params)),
        "rounding": rounding.init(dict(params)),
        "noop": fmp.NoOpLossScale(),
    }


if __name__ == "__main__":
    print(fmp.__file__)
    if sys.argv[3:] == ["fmp"]:
        fmp.serialization.save(legacy_states(), sys.argv[2])
    else:
        torch.save(legacy_states(), sys.argv[2])
