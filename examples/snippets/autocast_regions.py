import torch
from torch import nn

import fmp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
params = {k: v.detach() for k, v in model.named_parameters()}
x = torch.randn(8, 16)


def forward(params, x):
    return torch.func.functional_call(model, params, (x,))


# --8<-- [start:autocast]
# torch.autocast(device, dtype) as a function transform: Linear in bfloat16, layer_norm in float32.
out = fmp.autocast.autocast(forward, torch.bfloat16)(params, x)
# torch's CPU rules instead of the default ("cuda") ones, and one op changed.
out_cpu = fmp.autocast.autocast(forward, torch.bfloat16, rules="cpu", overrides={"layer_norm": None})(params, x)


# custom_fwd(cast_inputs=torch.float32) and autocast(enabled=False) as transforms.
def rotary(x):
    return torch.cos(x) * x


rotary_f32 = fmp.autocast.fixed_dtype(rotary, torch.float32)  # inputs cast to float32, autocast off inside
rotary_uncast = fmp.autocast.no_autocast(rotary)  # autocast off inside, inputs as they come

# A policy per module (Haiku style): the LayerNorm in float32 whatever the step's policy.
norm_f32 = fmp.autocast.module_policies(forward, model, {nn.LayerNorm: fmp.get_policy("float32")})
out_mixed = fmp.autocast.autocast(norm_f32, torch.bfloat16)(params, x)
# --8<-- [end:autocast]
print(out.dtype, out_cpu.dtype, out_mixed.dtype, rotary_f32(x.bfloat16()).dtype, rotary_uncast(x).dtype)
