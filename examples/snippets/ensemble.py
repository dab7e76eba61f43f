import copy
import functools

import torch
from torch import nn

import fmp

# --8<-- [start:ensemble]
members = [nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)) for _ in range(4)]
stacked, _ = torch.func.stack_module_state(members)
params = {name: p.detach() for name, p in stacked.items()}
skeleton = copy.deepcopy(members[0]).to("meta")  # the structure, without weights


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(skeleton, params, (x,)), y)


policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-2)
# One state per member, each with a scale of its own, stacked along a new leading dimension.
state = fmp.stack_trees(
    [
        fmp.TrainState.create(
            {k: v[i] for k, v in params.items()},
            optimizer,
            fmp.DynamicLossScale.create(init_scale=2.0 ** (8 + 2 * i)),
        )
        for i in range(len(members))
    ]
)
step = torch.func.vmap(functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer))
xs, ys = torch.randn(4, 16, 8), torch.randn(4, 16, 1)
xs[1, 0, 0] = float("inf")  # member 1 alone skips this step and backs its scale off
state, info = step(state, xs, ys)
print(info.grads_finite.tolist(), state.scaler.loss_scale.tolist())
member_0 = fmp.unstack_tree(state, 0)  # one member's TrainState
# --8<-- [end:ensemble]
assert info.grads_finite.tolist() == [True, False, True, True]
