import torch

import fmp

params = {"w": torch.randn(4, 2)}
optimizer = fmp.optim.adamw(1e-3)
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
x, y = torch.randn(8, 4), torch.randn(8, 2)


def loss_fn(params, x, y):
    return torch.nn.functional.mse_loss(x @ params["w"], y)


# A NaN in Adam's first moment: finite gradients, a non-finite update.
state = state._replace(opt_state=state.opt_state._replace(exp_avg={"w": torch.full((4, 2), float("nan"))}))
# --8<-- [start:check-update]
state, info = fmp.train_step(loss_fn, state, x, y, policy=policy, optimizer=optimizer, check_update=True)
# --8<-- [end:check-update]
assert not bool(info.applied) and torch.equal(state.params["w"], params["w"])
print("skipped a non-finite update; bad updates so far:", int(state.counts.bad_update))
