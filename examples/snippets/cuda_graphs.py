import functools

import torch
from torch import nn

import fmp

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
policy = fmp.get_policy("params=float32,compute=half,output=float32", device_type=device)
optimizer = fmp.optim.adamw(1e-3)


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


params = {k: v.detach() for k, v in model.named_parameters()}
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
# --8<-- [start:graphs]
for t in torch.utils._pytree.tree_leaves(state):
    torch._dynamo.mark_static_address(t)  # the state lives at fixed addresses: replays need no copies
step = fmp.compile(
    functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=True),
    mode="reduce-overhead",
)
losses = []
for _ in range(3):
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
    state, info = step(state, x, y)
    losses.append(info.loss.clone())  # a replay's outputs are overwritten by the next one: clone to keep
# --8<-- [end:graphs]
print([float(v) for v in losses])
