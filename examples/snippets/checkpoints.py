import os
import tempfile

import torch
from torch import nn

import fmp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
x, y = torch.randn(4, 8), torch.randn(4, 1)
directory = tempfile.mkdtemp()
path = os.path.join(directory, "checkpoint.pt")

# --8<-- [start:from-torch-amp]
# A torch.amp run, checkpointed mid-training.
torch_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
grad_scaler = torch.amp.GradScaler("cpu")
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = nn.functional.mse_loss(model(x), y)
grad_scaler.scale(loss).backward()
grad_scaler.step(torch_optimizer)
grad_scaler.update()

# fmp goes on from it: the params, the optimizer state and the loss scale, all converted.
params = {k: v.detach() for k, v in model.named_parameters()}
optimizer, opt_state = fmp.interop.from_torch_state_dict("adamw", torch_optimizer.state_dict(), params, 1)
scaler = fmp.DynamicLossScale.from_state_dict(grad_scaler.state_dict())
state = fmp.TrainState.create(params, optimizer, scaler)._replace(opt_state=opt_state)
# --8<-- [end:from-torch-amp]
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


state, info = fmp.train_step(loss_fn, state, x, y, policy=policy, optimizer=optimizer)

# --8<-- [start:to-torch-amp]
grad_scaler.load_state_dict(state.scaler.state_dict())  # GradScaler reads its five keys
torch_optimizer.load_state_dict(fmp.interop.to_torch_state_dict(state.opt_state, torch_optimizer))
model.load_state_dict(state.params, strict=False)
# --8<-- [end:to-torch-amp]

# --8<-- [start:save-load]
torch.save(state, path)  # a TrainState, or any part of it, as it is
restored = torch.load(path, weights_only=True)  # torch's safe default: fmp's classes are allowed
assert torch.equal(restored.params["0.weight"], state.params["0.weight"])
# --8<-- [end:save-load]
print(float(restored.scaler.loss_scale))

# --8<-- [start:fmp-save-load]
fmp.serialization.save(state, path)  # atomic: a crash mid-save leaves the previous file whole

# On resume: build the state as the run did, then load into its structure and devices.
target = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
state = fmp.serialization.load(path, target)

# Or restore without allocating twice: an abstract target on the meta device.
abstract = torch.utils._pytree.tree_map(lambda t: torch.empty_like(t, device="meta"), target)
state = fmp.serialization.load(path, abstract, device="cpu")
# --8<-- [end:fmp-save-load]
assert torch.equal(state.params["0.weight"], restored.params["0.weight"])
