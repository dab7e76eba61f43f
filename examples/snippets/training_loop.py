import functools

import torch
from torch import nn

import fmp

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
params = {k: v.detach() for k, v in model.named_parameters()}
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


# --8<-- [start:loop]
schedule = fmp.optim.schedule.warmup_cosine(1e-3, warmup_steps=10, total_steps=100)
optimizer = fmp.optim.clip_by_global_norm(fmp.optim.adamw(schedule), max_norm=1.0)
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), accumulation_steps=4)
step = functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, grad_norm=True)
for i in range(8):  # 8 micro-batches: 2 optimizer steps
    state, info = step(state, torch.randn(32, 64), torch.randn(32, 1))
    if i % 4 == 3:
        fmp.raise_if_stalled(state, patience=100)  # opt-in fail-fast; reads one counter (a sync)
print(int(state.counts.applied), int(state.counts.skipped), int(state.opt_state.step))
# --8<-- [end:loop]
assert int(state.counts.applied) == 2
