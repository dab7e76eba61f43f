import torch
import torch.nn.functional as F
from torch import nn

import fmp

# --8<-- [start:batchnorm]
cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(392, 10))
params, buffers = fmp.nn.split(cnn)  # trainable params (tied weights once, frozen ones left out), buffers


def cnn_loss(params, buffers, x, y):  # takes the model state, returns it updated
    logits, buffers = fmp.nn.call(cnn, params, buffers, x)
    return F.cross_entropy(logits, y), buffers


policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")  # torch.amp's CPU rules
optimizer = fmp.optim.adamw(1e-3)
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=buffers)
for x, y in [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))] * 3:
    state, info = fmp.train_step(cnn_loss, state, x, y, policy=policy, optimizer=optimizer)
fmp.nn.write_back(cnn, state.params, state.model_state)  # for cnn.eval() or state_dict()
# --8<-- [end:batchnorm]
print(int(state.counts.applied), int(cnn[1].num_batches_tracked))
assert int(cnn[1].num_batches_tracked) == 3
