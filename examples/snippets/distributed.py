import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import fmp
import fmp.distributed

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-3)


def loss_fn(params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


x_local, y_local = torch.randn(4, 8), torch.randn(4, 1)  # this rank's batch
# One rank here, so that the snippet runs anywhere; under torchrun the environment gives rank and world size.
store = os.path.join(tempfile.mkdtemp(), "store")
init = {"init_method": f"file://{store}", "rank": 0, "world_size": 1}
# --8<-- [start:ddp]
# "gloo" or "nccl"; one process per device, e.g. under torchrun. A failed collective raises
# fmp.distributed.CollectiveError within the group's timeout (gloo's default is 30 minutes).
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5), **init)
params = fmp.distributed.broadcast_tree({k: v.detach() for k, v in model.named_parameters()})  # rank 0's values
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
state, info = fmp.distributed.train_step(loss_fn, state, x_local, y_local, policy=policy, optimizer=optimizer)
# --8<-- [end:ddp]
print(bool(info.applied))
dist.destroy_process_group()
