import torch
from torch import nn

import fmp

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
params = {k: v.detach() for k, v in model.named_parameters()}
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.sgd(0.01)


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
x, y = torch.randn(4, 8), torch.randn(4, 1)
x[0, 0] = float("inf")
# --8<-- [start:locate]
state, info = fmp.train_step(loss_fn, state, x, y, policy=policy, optimizer=optimizer)
if not bool(info.applied):  # a sync: check where you log, not every step
    print(fmp.debug.locate_nonfinite(loss_fn, state.params, x, y, policy=policy, scaler=state.scaler))
# --8<-- [end:locate]
