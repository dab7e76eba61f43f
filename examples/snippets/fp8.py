import torch
from torch import nn

import fmp
import fmp.fp8

# --8<-- [start:modules]
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
params, _ = fmp.nn.split(model)


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y)


# Every nn.Linear computes in FP8 with per-tensor scales; the rest follows the bfloat16 policy.
fp8_loss = fmp.fp8.fp8_modules(loss_fn, model, {nn.Linear: fmp.fp8.tensorwise()})
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-3)
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
x, y = torch.randn(32, 64), torch.randn(32, 64)
for _ in range(3):
    state, info = fmp.train_step(fp8_loss, state, x, y, policy=policy, optimizer=optimizer)
# --8<-- [end:modules]
print(float(info.loss))

# --8<-- [start:rowwise]
# A power-of-two scale per row: an outlier token or feature no longer flattens the rest.
rowwise_loss = fmp.fp8.fp8_modules(loss_fn, model, {nn.Linear: fmp.fp8.rowwise()})
state, info = fmp.train_step(rowwise_loss, state, x, y, policy=policy, optimizer=optimizer)
# --8<-- [end:rowwise]

# --8<-- [start:mxfp8]
# Every dim a matmul contracts (features, and tokens for the weight's gradient) a multiple of 32.
mx_loss = fmp.fp8.fp8_modules(loss_fn, model, {nn.Linear: fmp.fp8.mxfp8()})
state, info = fmp.train_step(mx_loss, state, x, y, policy=policy, optimizer=optimizer)
# --8<-- [end:mxfp8]

# --8<-- [start:blockwise]
# The last layer stays in bfloat16, as DeepSeek-V3 keeps its output head out of FP8.
blockwise_loss = fmp.fp8.fp8_modules(loss_fn, model, {"0": fmp.fp8.blockwise(block=32)})
state, info = fmp.train_step(blockwise_loss, state, x, y, policy=policy, optimizer=optimizer)
# --8<-- [end:blockwise]
assert int(state.counts.applied) == 6

# --8<-- [start:delayed]
recipes = {nn.Linear: fmp.fp8.delayed(history_len=16)}  # Transformer Engine's DelayedScaling
# One DelayedScalingState per layer (amax history and scales), in the state beside the loss scale.
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), fp8=fmp.fp8.init_states(model, recipes))
delayed_loss = fmp.fp8.fp8_modules(loss_fn, model, recipes)
for _ in range(3):
    state, info = fmp.train_step(delayed_loss, state, x, y, policy=policy, optimizer=optimizer)
# --8<-- [end:delayed]
print(state.fp8["0"].scale)  # layer 0's input, weight and gradient scales for the next step
assert int(state.counts.applied) == 3

# --8<-- [start:by_hand]
layer_state = fmp.fp8.delayed(history_len=16).init()
weight = torch.randn(64, 64) / 8


def layer_loss(weight, scales):
    return fmp.fp8.fp8_linear(x, weight, recipe=fmp.fp8.delayed(history_len=16), scales=scales).square().mean()


for _ in range(3):
    # The scales' gradient is this step's amaxes of the input, the weight and the output gradient.
    grad, amaxes = torch.func.grad(layer_loss, argnums=(0, 1))(weight, layer_state.scale)
    weight = weight - 0.1 * grad
    layer_state = layer_state.update(amaxes)  # the next step's scales: a new state, nothing written
# --8<-- [end:by_hand]
