import functools

import torch
import torch.nn.functional as F
from torch import nn

import fmp


class Attention(nn.Module):
    """One causal self-attention layer with a regression loss."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        return F.mse_loss(self.out(h), y)


model = Attention()
params, buffers = fmp.nn.split(model)


def loss_fn(params, buffers, x, y):
    return fmp.nn.call(model, params, buffers, x, y)


# --8<-- [start:float32-attention]
# torch's CPU rules with one op changed: attention takes its inputs (the bfloat16 projections) in float32.
policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu").with_overrides(
    {"scaled_dot_product_attention": torch.float32}
)
optimizer = fmp.optim.adamw(1e-3)
state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=buffers)
train_step = fmp.compile(functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=True))
# --8<-- [end:float32-attention]
x, y = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
state, info = train_step(state, x, y)
print(float(info.loss))
