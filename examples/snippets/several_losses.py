import torch
from torch import nn

import fmp


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.encoder(x))
        return self.a(h), self.b(h)


model = TwoHeads()
params = {k: v.detach() for k, v in model.named_parameters()}
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
optimizer = fmp.optim.adamw(1e-3)


# --8<-- [start:losses]
def loss_fn(params, x, y_a, y_b):  # one loss per scaler; no dropout: each loss runs its own forward
    out_a, out_b = torch.func.functional_call(model, params, (x,))
    return nn.functional.mse_loss(out_a, y_a), nn.functional.cross_entropy(out_b, y_b)


scalers = (fmp.DynamicLossScale.create(), fmp.DynamicLossScale.create(init_scale=2.0**10))
state = fmp.TrainState.create(params, optimizer, scalers)
for _ in range(3):
    x, y_a, y_b = torch.randn(8, 16), torch.randn(8, 1), torch.randint(0, 4, (8,))
    state, info = fmp.train_step(loss_fn, state, x, y_a, y_b, policy=policy, optimizer=optimizer)
print([float(s.loss_scale) for s in state.scaler], bool(info.applied))
# --8<-- [end:losses]
