"""Data-parallel mixed precision on `torch.distributed`: averaged gradients, one skip decision for all ranks.

Replace `fmp.train_step` with `fmp.distributed.train_step` and run one process per device (NCCL
on GPUs, gloo on CPUs, e.g. under torchrun). Each rank computes gradients on its own batch; they
are averaged across the group in the policy's reduce dtype (`Policy.reduce_dtype`, as FSDP's; by
default the param dtype) in a few flat buckets, and the finite flags travel in the same
all-reduce, so every rank skips the same steps and moves its loss scale identically. Nothing
reads a tensor on the host, and the collectives are torch's functional ones, which
`torch.compile(fullgraph=True)` traces::

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    params = fmp.distributed.broadcast_tree(params)  # every replica starts from rank 0's values
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    state, info = fmp.distributed.train_step(loss_fn, state, x_local, y_local, policy=policy, optimizer=optimizer)

The reduce dtype: the default (the param dtype, usually float32) loses nothing. bfloat16 halves
the bytes on the wire and rounds each rank's contribution and each partial sum to 8 significant
bits (a relative error around 2**-9 per element for 2 ranks, growing with the number of ranks).
float16 buffers travel multiplied by the loss scale, as the scaled gradients of torch.amp + DDP
do, so small gradients do not flush to zero and a sum that overflows backs the scale off.

Every rank must pass the same policy, optimizer and state structure, as with DDP: the buckets'
sizes and dtypes follow from them. `broadcast_tree`, and the step's first eager call for each
state layout, compare the ranks' paths, shapes and dtypes once (a host sync) and raise on every
rank with the first leaf that differs, where a collective would sum unrelated gradients (the
same sizes) or abort in the backend (other sizes); later steps only look the layout up on the
host. A compiled step skips the comparison: call `broadcast_tree` first. `check_replicas`
compares the values where a run can afford the sync.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards the parameters and reduce-scatters the
gradients itself inside `backward()`, in its `reduce_dtype` and on the scaled gradients, so it
replaces the reduction here; fmp supplies the loss scale, the skip decision agreed across ranks
(an inf may sit in one rank's shard only) and the optimizer, on each rank's shards. FSDP2's
`param_dtype` is fmp's compute dtype, and its `reduce_dtype=None` means that compute dtype, where
fmp's default is the param dtype; so map the policy explicitly (tested on CPU with gloo)::

    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=policy.effective_reduce_dtype)
    fully_shard(model, mp_policy=mp)  # after fully_shard on each block
    with torch.no_grad():  # the local shards, sharing storage with the module's parameters
        params = {n: p.to_local() for n, p in model.named_parameters()}
    opt_state = optimizer.init(params)
    # each step:
    scaler.scale(loss_fn(model(x), y)).backward()
    grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
    grads, finite, _, scaler = fmp.distributed.unscale_and_adjust(scaler, grads)
    new_params, opt_state = fmp.select_tree(finite, optimizer.update(grads, opt_state, params), (params, opt_state))
    with torch.no_grad():
        for n, value in new_params.items():
            params[n].copy_(value)
    model.zero_grad()

`fmp.distributed.train_step` itself cannot drive an FSDP2 module: `torch.func` differentiates
with respect to the params it is given, while FSDP2's all-gather and reduce-scatter hooks act on
the module's own parameters.
"""

from __future__ import annotations

from fmp.distributed._reduce import CollectiveError
from fmp.distributed._reduce import Collectives
from fmp.distributed._reduce import agree_finite
from fmp.distributed._reduce import all_reduce_gradients
from fmp.distributed._replicas import broadcast_tree
from fmp.distributed._replicas import check_replicas
from fmp.distributed._step import train_step
from fmp.distributed._step import unscale_and_adjust

__all__ = [
    "CollectiveError",
    "Collectives",
    "agree_finite",
    "all_reduce_gradients",
    "broadcast_tree",
    "check_replicas",
    "train_step",
    "unscale_and_adjust",
]
