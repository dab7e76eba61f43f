"""fmp's precision regions: nesting (innermost wins), fixed-dtype regions, per-module policies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode

import fmp
from fmp.autocast import autocast
from fmp.autocast._module_policy import module_policies
from fmp.autocast._regions import fixed_dtype
from fmp.autocast._regions import no_autocast
from fmp.autocast._rules import CPU
from fmp.autocast._transform import active_modes

BF16 = fmp.Policy(torch.float32, torch.bfloat16, torch.float32)
NORM_F32 = fmp.get_policy("p=f32,c=f32,o=bf16")  # Haiku's norm policy: float32 inside, bfloat16 out


class Recorder(TorchFunctionMode):
    """Records each torch call's name and tensor arguments, as the op finally runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        self.calls.append((getattr(func, "__name__", ""), tensors))
        return func(*args, **kwargs)

    def dtypes(self, name: str) -> list[list[torch.dtype]]:
        return [[x.dtype for x in tensors] for op, tensors in self.calls if op == name]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> tuple[Net, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    return model, {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.named_parameters()}


def _loss(model: nn.Module, policy: fmp.Policy | None = None) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if policy is not None:  # what fmp.mixed_precision_grad does before calling the loss
            params, x = policy.cast_to_compute((params, x))
        return torch.func.functional_call(model, params, (x,)).float().pow(2).mean()

    return loss


def _no_forward_left(model: nn.Module) -> bool:
    leftovers = {"forward", "_fmp_module_policy"}
    return all(not leftovers & vars(m).keys() for m in model.modules()) and active_modes() == []


def test_fixed_dtype_runs_in_its_dtype_inside_autocast() -> None:
    def body(a: torch.Tensor, pair: list[torch.Tensor], n: torch.Tensor) -> list[torch.dtype]:
        return [(a @ a).dtype, pair[0].dtype, pair[1].dtype, n.dtype, torch.softmax(a, -1).dtype]

    a = torch.randn(3, 3, dtype=torch.bfloat16)
    pair = [torch.randn(3, dtype=torch.float16), torch.randn(3, dtype=torch.float64)]
    region = fixed_dtype(body, torch.float32)
    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    # Inputs cast (float64 and integers kept), and softmax not re-cast by the outer rules.
    assert autocast(region, torch.bfloat16)(a, pair, torch.arange(3)) == [f32, f32, f64, i64, f32]
    batched = torch.func.vmap(autocast(fixed_dtype(lambda b: b @ b, torch.float32), torch.bfloat16))
    assert batched(torch.randn(2, 3, 3, dtype=torch.bfloat16)).dtype == torch.float32
    # no_autocast: no input casts, no op casts: a float32 matmul stays float32 under bfloat16 autocast.
    x = torch.randn(3, 3)
    assert autocast(lambda y: no_autocast(torch.mm)(y, y), torch.bfloat16)(x).dtype == torch.float32
    with pytest.raises(TypeError, match=r"fixed_dtype's dtype must be a floating-point torch\.dtype"):
        fixed_dtype(body, torch.int32)


def test_innermost_region_wins_and_outer_rules_resume() -> None:
    x = torch.randn(4, 4)

    def body(y: torch.Tensor) -> list[torch.dtype]:
        inner_half = autocast(lambda z: torch.layer_norm(z @ z, (4,)), torch.float16, overrides={"layer_norm": None})
        inner_cpu = autocast(lambda z: torch.softmax(z, -1), torch.float16, rules="cpu")
        return [inner_half(y).dtype, inner_cpu(y.half()).dtype, (y @ y).dtype, torch.softmax(y.half(), -1).dtype]

    # fp16 matmul and uncast layer_norm inside; softmax by the CPU rules (not cast); bfloat16 after.
    assert autocast(body, torch.bfloat16)(x) == [torch.float16, torch.float16, torch.bfloat16, torch.float32]
    # The inner region also wins under vmap and grad.
    twice = autocast(lambda z: autocast(lambda w: w @ w, torch.float16)(z).float().sum(), torch.bfloat16)
    assert torch.func.vmap(torch.func.grad(twice))(torch.randn(2, 3, 3)).dtype == torch.float32
    assert active_modes() == []


def test_regions_unwind_on_errors() -> None:
    def boom(y: torch.Tensor) -> torch.Tensor:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        autocast(lambda y: autocast(boom, torch.float16)(y), torch.bfloat16)(torch.ones(1))
    assert active_modes() == [] and not torch.overrides._get_current_function_mode_stack()


def test_regions_are_per_thread() -> None:
    seen: list[tuple[int, torch.dtype]] = []

    def body(x: torch.Tensor) -> int:
        # A thread started inside a region is outside it, as with torch's own (thread-local) mode stack.
        thread = threading.Thread(target=lambda: seen.append((len(active_modes()), (x @ x).dtype)))
        thread.start()
        thread.join()
        return len(active_modes())

    assert autocast(body, torch.bfloat16)(torch.randn(2, 2)) == 1
    assert seen == [(0, torch.float32)]


class _MatMul(torch.autograd.Function):
    """A hand-written Function that records the dtypes its forward and backward run in."""

    seen: ClassVar[list[tuple[str, torch.dtype]]] = []

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x @ w
        _MatMul.seen.append(("forward", out.dtype))
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        grad_x, grad_w = grad @ w.T, x.T @ grad
        _MatMul.seen.append(("backward", grad_x.dtype))
        return grad_x, grad_w


def test_fixed_dtype_autograd_function_grads_come_back_in_input_dtypes() -> None:
    matmul = fixed_dtype(_MatMul.apply, torch.float32)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, w).pow(2).sum()

    w, x = torch.randn(4, 4), torch.randn(2, 4, dtype=torch.bfloat16)
    _MatMul.seen.clear()
    grad_w, grad_x = torch.func.grad(autocast(loss, torch.bfloat16), argnums=(0, 1))(w, x)
    assert (grad_w.dtype, grad_x.dtype) == (torch.float32, torch.bfloat16)
    reference = torch.func.grad(loss, argnums=(0, 1))(w, x.float())
    torch.testing.assert_close(grad_w, reference[0])
    # torch.autograd.grad called inside an autocast region: the backward still runs in float32.
    w_leaf = w.clone().requires_grad_()
    inside = autocast(lambda: torch.autograd.grad(loss(w_leaf, x), w_leaf)[0], torch.bfloat16)()
    torch.testing.assert_close(inside, grad_w)
    assert set(_MatMul.seen) == {("forward", torch.float32), ("backward", torch.float32)}
    assert active_modes() == []


def test_norm_layers_in_float32_under_a_bfloat16_policy() -> None:
    model, params = _net()
    x = torch.randn(4, 8)
    plain, kept = _loss(model, BF16), module_policies(_loss(model, BF16), model, {nn.LayerNorm: NORM_F32})
    for fn, want in ((plain, torch.bfloat16), (kept, torch.float32)):
        with Recorder() as recorder:
            grads = torch.func.grad(fn)(params, x)
        assert recorder.dtypes("layer_norm") == [[want] * 3] * 2  # input, weight, bias of both norms
        assert {name: g.dtype for name, g in grads.items()} == dict.fromkeys(params, torch.float32)
        assert _no_forward_left(model)
    # The linears stay in bfloat16: the norms' outputs are cast back by the policy's output dtype.
    assert {d for ds in recorder.dtypes("linear") for d in ds} == {torch.bfloat16}


def test_module_policies_with_mixed_precision_grad_and_a_plain_module_call() -> None:
    model, params = _net()
    loss = module_policies(_loss(model), model, {nn.LayerNorm: NORM_F32})
    with Recorder() as recorder:
        out = fmp.mixed_precision_grad(loss, params, fmp.DynamicLossScale.create(), torch.randn(4, 8), policy=BF16)
    assert recorder.dtypes("layer_norm") == [[torch.float32] * 3] * 2 and bool(out.grads_finite)
    assert {g.dtype for g in out.grads.values()} == {torch.float32}
    # Called as model(x), outside functional_call: the module's own parameters, put back after.
    model = model.to(torch.bfloat16)
    with Recorder() as recorder:
        y = module_policies(model, model, {nn.LayerNorm: NORM_F32})(torch.randn(2, 8, dtype=torch.bfloat16))
    y.float().sum().backward()
    assert recorder.dtypes("layer_norm") == [[torch.float32] * 3] * 2
    assert all(isinstance(p, nn.Parameter) and p.grad is not None for p in model.parameters())
    assert _no_forward_left(model)


def test_module_policy_wins_over_autocast_and_nested_matches_cast_from_originals() -> None:
    model, params = _net()
    policies = {"blocks.*.norm": fmp.get_policy("f32"), "blocks.*": fmp.get_policy("c=bf16,o=f32")}
    # A copy of the CPU rules runs fmp's Python mode, whose casts the recorder sees as calls.
    loss = autocast(module_policies(_loss(model), model, policies), torch.float16, rules=dict(CPU))
    with Recorder() as recorder:
        loss(params, torch.randn(4, 8))
    # CPU rules leave layer_norm uncast: the norm policy runs it in float32, on the original
    # parameters rather than copies rounded through the block's bfloat16.
    norms = [tensors for op, tensors in recorder.calls if op == "layer_norm"]
    assert len(norms) == 2
    for i, (inp, weight, bias) in enumerate(norms):
        assert inp.dtype == torch.float32
        assert torch.equal(weight, params[f"blocks.{i}.norm.weight"])
        assert torch.equal(bias, params[f"blocks.{i}.norm.bias"])
    # The blocks' linears run in their policy's bfloat16, the unmatched head under float16 autocast.
    assert recorder.dtypes("linear") == [[torch.bfloat16] * 3] * 2 + [[torch.float16] * 3]


def test_module_policies_inside_a_native_region_run_their_own_dtypes() -> None:
    # rules="cpu" on CPU tensors runs on torch.autocast itself; a module policy inside turns it off.
    model, params = _net()
    policies = {"blocks.*.norm": fmp.get_policy("f32"), "blocks.*": fmp.get_policy("c=bf16,o=f32")}
    outputs: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.dtype))
    seen: list[bool] = []
    model.blocks[0].mlp.register_forward_pre_hook(lambda m, i: seen.append(torch.is_autocast_enabled("cpu")))
    model.head.register_forward_pre_hook(lambda m, i: seen.append(torch.is_autocast_enabled("cpu")))
    autocast(module_policies(_loss(model), model, policies), torch.float16, rules="cpu")(params, torch.randn(4, 8))
    # The blocks' linears return their policy's float32 output; the unmatched head runs under float16 autocast.
    assert outputs == {"blocks.0.mlp": torch.float32, "blocks.1.mlp": torch.float32, "head": torch.float16}
    assert seen == [False, True]


def test_module_policies_under_vmap_of_grad() -> None:
    model, params = _net()
    loss = module_policies(_loss(model, BF16), model, {nn.LayerNorm: NORM_F32})
    xs = torch.randn(3, 4, 8)
    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    one = torch.func.grad(loss)(params, xs[1])
    for name, g in grads.items():
        assert g.shape == (3, *params[name].shape) and g.dtype == torch.float32
        torch.testing.assert_close(g[1], one[name], **TOLERANCES[torch.bfloat16])  # batched bf16 rounds differently
    assert _no_forward_left(model)


def test_module_policies_validate_and_do_not_leak_on_errors() -> None:
    model, params = _net()
    with pytest.raises(ValueError, match=r"module name pattern 'block\.\*' matches no module"):
        module_policies(_loss(model), model, {"block.*": BF16})
    with pytest.raises(TypeError, match=r"the policy for 'head' must be an fmp.Policy .* got str"):
        module_policies(_loss(model), model, {"head": "bf16"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"neither an nn\.Module subclass nor a name pattern"):
        module_policies(_loss(model), model, {F.layer_norm: BF16})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"module class Conv2d matches no module of the model; classes: 'Net', "):
        module_policies(_loss(model), model, {nn.Conv2d: BF16})
    with pytest.raises(TypeError, match=r"needs an nn\.Module, got dict"):
        module_policies(_loss(model), params, {"head": BF16})  # type: ignore[arg-type]

    def bad(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        torch.func.functional_call(model, params, (x,))
        raise ValueError("after the model")

    with pytest.raises(ValueError, match="after the model"):
        module_policies(bad, model, {nn.Linear: BF16, "": fmp.get_policy("f32")})(params, torch.randn(2, 8))
    assert _no_forward_left(model)
    out = model(torch.randn(2, 8))  # the model is its plain self again
    assert out.dtype == torch.float32
    twice = module_policies(module_policies(_loss(model), model, {"head": BF16}), model, {nn.Linear: BF16})
    with pytest.raises(RuntimeError, match=r"module 'head' is already under module_policies"):
        twice(params, torch.randn(2, 8))
    assert _no_forward_left(model)


def test_module_policies_wrap_a_forward_patched_on_the_instance_and_put_it_back() -> None:
    model, params = _net()
    patched = model.head.forward
    model.head.forward = lambda x: patched(x) * 2  # what hooks libraries do
    try:
        before = vars(model.head)["forward"]
        with Recorder() as recorder:
            out = module_policies(_loss(model), model, {"head": BF16})(params, torch.randn(2, 8))
        assert out.dtype == torch.float32 and recorder.dtypes("linear")[-1] == [torch.bfloat16] * 3
        assert vars(model.head)["forward"] is before and "_fmp_module_policy" not in vars(model.head)
    finally:
        del model.head.forward


def _bn_net(dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    # No bias before the norm: its gradient is zero but for rounding, which no tolerance fits.
    if dims == 1:
        return nn.Sequential(nn.Linear(6, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 2)
    )


def _bn_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    # Running statistics away from their initial values, so that eval mode normalizes with something.
    buffers = {k: v + 0.1 * torch.rand_like(v) if v.is_floating_point() else v for k, v in model.named_buffers()}
    return params, buffers


def _bn_loss(model: nn.Module, policy: fmp.Policy | None = None) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if policy is not None:  # what fmp.mixed_precision_grad does before calling the loss
            params, x = policy.cast_to_compute((params, x))
        # The buffers come in as an argument: torch.func.grad refuses in-place updates of captured tensors.
        return torch.func.functional_call(model, {**params, **buffers}, (x,)).float().pow(2).mean()

    return loss


def _clone(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tree.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_under_a_16_bit_policy_runs_torch_mixed_kernel(dtype: torch.dtype, dims: int, train: bool) -> None:
    model = _bn_net(dims).train(train)
    params, initial = _bn_state(model)
    x = torch.randn(8, 6) if dims == 1 else torch.randn(8, 3, 6, 6)
    buffers, reference = _clone(initial), _clone(initial)
    loss = _bn_loss(model)
    kept = module_policies(loss, model, {_NormBase: fmp.Policy(torch.float32, dtype, torch.float32)})
    with Recorder() as recorder:
        grads = torch.func.grad(kept)(params, buffers, x)
    want = torch.func.grad(loss)(params, reference, x)
    # A 16-bit input with float32 weight, bias and statistics, as torch.autocast runs BatchNorm.
    assert recorder.dtypes("batch_norm") == [[dtype] + [torch.float32] * 4]
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, want[name], **TOLERANCES[dtype])
    # The caller's statistics are updated in place in training mode (not copies of them), else left alone.
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, reference[name], **TOLERANCES[dtype])
        assert torch.equal(buffer, initial[name]) != train
    assert _no_forward_left(model)


class ScaledLinear(nn.Linear):
    """A linear layer with a fixed output gain kept as a floating buffer (not a norm layer)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.register_buffer("gain", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * self.gain


def test_a_module_with_a_floating_buffer_that_is_no_norm_runs_in_the_compute_dtype() -> None:
    torch.manual_seed(0)
    layer, x = ScaledLinear(8), torch.randn(4, 8)
    seen: list[torch.dtype] = []
    original = F.linear

    def recording_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.extend([x.dtype, weight.dtype])
        return original(x, weight, bias)

    F.linear = recording_linear  # type: ignore[assignment]
    try:
        out = module_policies(layer, layer, {"": fmp.get_policy("c=bf16,o=f32")})(x)
    finally:
        F.linear = original
    assert seen == [torch.bfloat16, torch.bfloat16] and out.dtype == torch.float32
    assert layer.gain.dtype == torch.float32  # the buffer itself is never cast


def test_batch_norm_in_a_matched_model_takes_its_parameters_in_its_statistics_dtype() -> None:
    model = _bn_net(1)
    params, buffers = _bn_state(model)
    params = fmp.get_policy("bf16").cast_to_param(params)  # the caller keeps bfloat16 parameters
    loss = module_policies(_bn_loss(model), model, {"": fmp.get_policy("c=bf16,o=f32")})
    before = buffers["1.running_mean"].clone()
    with Recorder() as recorder:
        grads = torch.func.grad(loss)(params, buffers, torch.randn(8, 6))
    # The linears in bfloat16, the nested BatchNorm on float32 copies of its bfloat16 weight and bias.
    assert recorder.dtypes("linear") == [[torch.bfloat16] * 2, [torch.bfloat16] * 3]  # the first has no bias
    assert recorder.dtypes("batch_norm") == [[torch.bfloat16] + [torch.float32] * 4]
    assert {g.dtype for g in grads.values()} == {torch.bfloat16} and not torch.equal(buffers["1.running_mean"], before)


def test_batch_norm_float32_policy_under_vmap_of_grad_updates_per_example_statistics() -> None:
    model = _bn_net(1)
    params, initial = _bn_state(model)
    loss = module_policies(_bn_loss(model, BF16), model, {_NormBase: NORM_F32})
    xs = torch.randn(3, 8, 6)
    stacked = {k: torch.stack([v] * 3) for k, v in initial.items()}
    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, stacked, xs)
    for i in range(3):
        buffers = _clone(initial)
        one = torch.func.grad(loss)(params, buffers, xs[i])
        for name, grad in grads.items():
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad[i], one[name], **TOLERANCES[torch.bfloat16])  # batched bf16 rounds apart
        for name, buffer in buffers.items():
            torch.testing.assert_close(stacked[name][i], buffer, **TOLERANCES[torch.bfloat16])
    assert bool((stacked["1.num_batches_tracked"] == 1).all()) and _no_forward_left(model)


def test_a_matched_module_whose_forward_does_not_run_is_named_once() -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2)
    q = torch.randn(3, 1, 8)
    # MultiheadAttention hands out_proj.weight to its functional form; out_proj's forward never runs.
    fn = module_policies(lambda q: attention(q, q, q)[0], attention, {"out_proj": BF16})
    with pytest.warns(UserWarning, match=r"'out_proj' \(NonDynamicallyQuantizableLinear\) .* does not apply"):
        assert fn(q).dtype == torch.float32
    assert fn(q).dtype == torch.float32  # once: warnings are errors here
    assert _no_forward_left(attention)


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = self.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_a_shared_submodule_is_matched_by_its_second_name() -> None:
    model = _Shared()
    with Recorder() as recorder:
        out = module_policies(model, model, {"second": fmp.get_policy("c=bf16,o=f32")})(torch.randn(2, 4))
    assert out.dtype == torch.float32 and recorder.dtypes("linear") == [[torch.bfloat16] * 3] * 2
    assert _no_forward_left(model)


class _GraphCapture:
    """A torch.compile backend that keeps each graph Dynamo hands it and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.compiled
def test_compiled_module_policies_fullgraph_compile_once() -> None:
    model, params = _net()
    # An outer autocast that would run layer_norm in bfloat16: the norms' own region wins, compiled too.
    kept = module_policies(_loss(model, BF16), model, {nn.LayerNorm: NORM_F32})
    loss = autocast(kept, torch.bfloat16, overrides={"layer_norm": torch.bfloat16})
    backend = _GraphCapture()
    step = torch.compile(torch.func.grad(loss), fullgraph=True, backend=backend)
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        pytree.tree_map(torch.testing.assert_close, step(params, x), torch.func.grad(loss)(params, x))
    assert len(backend.graphs) == 1
    (graph,) = backend.graphs
    norms = [n for n in graph.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target)]
    assert len(norms) == 2
    assert {n.args[0].meta["example_value"].dtype for n in norms} == {torch.float32}
    assert _no_forward_left(model)
