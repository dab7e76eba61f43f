import torch
from torch import nn

import fmp


# --8<-- [start:remat]
class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + fmp.remat.remat(self.block)(x)  # keeps only x; reruns the block in the backward pass


model = nn.Sequential(*[Residual(32) for _ in range(4)], nn.Linear(32, 1))
# --8<-- [end:remat]
params = {k: v.detach() for k, v in model.named_parameters()}
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.sgd(0.01)


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
state, info = fmp.train_step(
    loss_fn, state, torch.randn(16, 32), torch.randn(16, 1), policy=policy, optimizer=optimizer
)
print(bool(info.applied))
assert bool(info.applied)
