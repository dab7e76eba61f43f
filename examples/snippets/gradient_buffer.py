import torch
from torch import nn

import fmp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
data[2][0][0, 0] = float("inf")  # one batch overflows: its step is skipped

# --8<-- [start:loop]
device = "cuda" if torch.cuda.is_available() else "cpu"
model = model.to(device)  # move or cast before attaching
grads = fmp.interop.GradientBuffer.attach(model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
scaler = fmp.DynamicLossScale.create(device=device)
for x, y in data:  # your batches
    with torch.autocast(device, dtype=fmp.half_dtype(device)):  # float16 on CUDA, bfloat16 on CPU
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
    grads.scale(loss, scaler).backward()  # not scaler.scale(loss): unscale_ refuses a backward it did not scale
    grads_finite, scaler = grads.unscale_(scaler)  # on device: nothing waits for the host
    grads.step(optimizer, grads_finite)  # params and optimizer state untouched where not finite
    grads.zero_()  # not optimizer.zero_grad(), which sets .grad to None and detaches the views
# --8<-- [end:loop]
print(float(scaler.loss_scale))
assert float(scaler.loss_scale) == 2.0**15
