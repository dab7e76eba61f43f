import functools

import torch
from torch import nn

import fmp

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def loss_fn(params, x, y):  # runs op by op as under torch.autocast: Linear in bf16, mse_loss in float32
    out = torch.func.functional_call(model, params, (x,))
    return nn.functional.mse_loss(out, y)


policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-3)
params = {k: v.detach() for k, v in model.named_parameters()}
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())

step = fmp.compile(functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer))
for x, y in [(torch.randn(32, 64), torch.randn(32, 1))] * 10:
    state, info = step(state, x, y)  # info.loss, info.grads_finite, info.loss_scale stay on device
print(float(info.loss), float(state.scaler.loss_scale))  # reading them syncs: do it when logging
