"""`torch.nn` modules as pure state: split a module into params and buffers, call it, write it back.

A BatchNorm model under `fmp.train_step`, its running statistics carried as model state::

    params, buffers = fmp.nn.split(model)
    state = fmp.TrainState.create(params, optimizer, scaler, model_state=buffers)

    def loss_fn(params, buffers, x, y):
        logits, buffers = fmp.nn.call(model, params, buffers, x)
        return F.cross_entropy(logits, y), buffers

    state, info = fmp.train_step(loss_fn, state, x, y, policy=policy, optimizer=optimizer)
    fmp.nn.write_back(model, state.params, state.model_state)
"""

from fmp.nn._module import call
from fmp.nn._module import split
from fmp.nn._module import write_back

__all__ = ["call", "split", "write_back"]
