import functools

import torch
from torch import nn

import fmp

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-3)
params = {k: v.detach() for k, v in model.named_parameters()}
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())

# --8<-- [start:donate]
step = fmp.compile(functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=True))
state, info = step(state, torch.randn(32, 64), torch.randn(32, 1))  # the old `state` is handed over
# --8<-- [end:donate]
# --8<-- [start:planned]
# On a CPU: Inductor allocates the step's temporaries as one block, which glibc keeps between steps.
planned = fmp.compile(
    functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=True),
    options={"memory_planning": True},
)
state, info = planned(state, torch.randn(32, 64), torch.randn(32, 1))
# --8<-- [end:planned]
loader = [(torch.randn(32, 64), torch.randn(32, 1)) for _ in range(3)]  # batches of the shapes compiled
# --8<-- [start:skip_guards]
with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
    for batch in loader:
        state, info = step(state, *batch)
# --8<-- [end:skip_guards]
# --8<-- [start:eager]
# Eager: torch's fused AdamW kernel skips an overflowing step by itself, with no select pass after it;
# donated, it writes into the state's own buffers, as torch.optim.AdamW(fused=True) does.
fused = fmp.optim.adamw(1e-3, fused=True)
eager_state = fmp.TrainState.create({k: v.clone() for k, v in params.items()}, fused, fmp.DynamicLossScale.create())
eager_state, info = fmp.train_step(
    loss_fn, eager_state, torch.randn(32, 64), torch.randn(32, 1), policy=policy, optimizer=fused, donate=True
)
# --8<-- [end:eager]
print(int(state.opt_state.step), float(info.loss_scale))
