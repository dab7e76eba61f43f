"""Precision policies: the dtypes of params, compute, outputs and reductions, and the op-level rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import cast

import torch

from fmp._tree import cast_floating
from fmp.autocast._overrides import Target
from fmp.autocast._overrides import checked_override
from fmp.autocast._overrides import resolve_rules
from fmp.autocast._rules import RULE_SETS
from fmp.autocast._rules import Cast

__all__ = ["Policy", "get_policy", "half_dtype"]

Tree = TypeVar("Tree")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "full": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "f64": torch.float64,
    "double": torch.float64,
}
_POLICY_DTYPES = frozenset(_DTYPE_NAMES.values())
_KEYS = {"params": "param_dtype", "p": "param_dtype", "compute": "compute_dtype", "c": "compute_dtype"}
_KEYS |= {"output": "output_dtype", "o": "output_dtype", "reduce": "reduce_dtype", "r": "reduce_dtype"}

_LOW_DTYPES = frozenset({torch.float16, torch.bfloat16})
_DEFAULT_RULES = "cuda"

# Device types where torch.autocast's default dtype is bfloat16 (float16 elsewhere, XPU and MPS included).
# Not asked of torch.get_autocast_dtype, which inside a region (or after set_autocast_dtype) reports that
# dtype instead; tests compare the set with torch's defaults.
_BFLOAT16_DEVICE_TYPES = frozenset({"cpu", "xla", "hpu", "maia"})
# Op tables of policies with overrides, by (rules, compute dtype, overrides): a plain dict, which a
# traced step reads as constants.
_OVERRIDE_TABLES: dict[
    tuple[str | None, torch.dtype, tuple[tuple[str, Cast | None], ...]], dict[str, Target | None]
] = {}


def _accelerator_type() -> str:
    # torch.accelerator arrived in torch 2.6; fmp supports 2.5, where CUDA is the accelerator to ask about.
    if hasattr(torch, "accelerator"):
        accelerator = torch.accelerator.current_accelerator()
        return "cpu" if accelerator is None else accelerator.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_type(device: str | torch.device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if not isinstance(device, str):
        raise TypeError(f"device_type must be a str or torch.device (e.g. 'cuda'), got {type(device).__name__}")
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise ValueError(f"device_type {device!r} is not a torch device (e.g. 'cuda', 'cpu', 'cuda:1')") from error


def half_dtype(device_type: str | torch.device | None = None) -> torch.dtype:
    """Returns torch.autocast's default 16-bit float: bfloat16 on CPU (and XLA, HPU, MAIA), else float16.

    Args:
        device_type: A device type such as "cuda" or "cpu", or a device ("cuda:1", `x.device`);
            None means the current accelerator if torch sees one, else "cpu".

    Returns:
        torch.bfloat16 or torch.float16.

    Raises:
        TypeError, ValueError: If `device_type` is not a device or names none torch knows.
    """
    kind = _accelerator_type() if device_type is None else _device_type(device_type)
    return torch.bfloat16 if kind in _BFLOAT16_DEVICE_TYPES else torch.float16


def _parse_dtype(name: str, device_type: str | torch.device | None) -> torch.dtype:
    key = name.strip().lower()
    if key == "half":
        return half_dtype(device_type)
    if key not in _DTYPE_NAMES:
        accepted = ", ".join([*_DTYPE_NAMES, "half"])
        raise ValueError(f"unknown dtype {name.strip()!r}; accepted: {accepted}")
    return _DTYPE_NAMES[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of stored parameters, of compute, of outputs and of reductions.

    A policy is configuration, not state: it is hashable and is not a pytree. Its casts touch
    floating-point tensor leaves only; everything else passes through untouched.

    Attributes:
        param_dtype: The dtype parameters (and gradients, and optimizer math) are kept in.
        compute_dtype: The dtype the forward and backward passes run in.
        output_dtype: The dtype of the loss function's result.
        reduce_dtype: The dtype gradients are averaged in across data-parallel ranks
            (`fmp.distributed`, as FSDP's `reduce_dtype`); None, the default, means `param_dtype`,
            and keeps following it through `with_param_dtype`. `effective_reduce_dtype` resolves it.
        rules: How a 16-bit `compute_dtype` is applied. "cuda" (the default, on every device) or
            "cpu": op by op, as `torch.autocast` does (`fmp.autocast` with that rule set): params
            and inputs keep their dtypes and each listed op casts its inputs, matmuls and
            convolutions to `compute_dtype`, softmax, norms, losses, exp/log/pow and reductions to
            float32, so `compute=float16` does not mean softmax in float16. None: jmp's
            semantics, params and floating inputs cast whole to `compute_dtype` before the loss
            function runs. A float32 or float64 `compute_dtype` casts whole either way.
        overrides: Per-op changes of `rules`, as `fmp.autocast.autocast`'s `overrides`: sorted
            `(op name, Cast or None)` pairs, set with `with_overrides`. Where the policy casts by
            op (`casts_by_op`: a 16-bit compute dtype), a loss function with any runs on fmp's own
            per-op mode rather than on torch.autocast; a float32 compute dtype casts whole and
            they change nothing. Empty by default.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    rules: str | None = _DEFAULT_RULES
    overrides: tuple[tuple[str, Cast | None], ...] = ()

    def __post_init__(self) -> None:
        if self.rules is not None and (not isinstance(self.rules, str) or self.rules not in RULE_SETS):
            raise ValueError(
                f"Policy.rules must be one of {sorted(RULE_SETS)} or None, got {self.rules!r}; for a rule set of "
                f"your own, wrap the loss function in fmp.autocast.autocast(fn, dtype, rules=...) and use a "
                f"policy that casts nothing whole (compute dtype that of the params)"
            )
        if self.overrides != _checked_overrides(dict(_pairs(self.overrides))):
            raise ValueError(
                f"Policy.overrides must be as with_overrides makes them: sorted, unique, keyed by op name, with "
                f"Cast or None values; got {self.overrides!r}; set them with policy.with_overrides({{op: rule}})"
            )
        if self.overrides and self.rules is None:
            raise ValueError(
                "Policy.overrides change a rule set, and rules=None casts whole: use rules 'cuda' or 'cpu', "
                "or clear the overrides first (policy.with_overrides({}))"
            )
        if self.overrides and self.compute_dtype in _LOW_DTYPES:
            # Resolved here, where the policy is made: a traced step only reads the table.
            key = (self.rules, self.compute_dtype, self.overrides)
            if key not in _OVERRIDE_TABLES:
                _OVERRIDE_TABLES[key] = resolve_rules(cast(str, self.rules), self.compute_dtype, dict(self.overrides))
        for field in dataclasses.fields(self):
            if field.name in ("rules", "overrides"):
                continue
            dtype = getattr(self, field.name)
            if dtype is None and field.name == "reduce_dtype":
                continue
            if not isinstance(dtype, torch.dtype) or dtype not in _POLICY_DTYPES:
                raise TypeError(f"Policy.{field.name} must be one of {sorted(map(str, _POLICY_DTYPES))}, got {dtype!r}")

    @property
    def casts_by_op(self) -> bool:
        """Whether the loss function runs under `fmp.autocast` (rules set and a 16-bit compute dtype)."""
        return self.rules is not None and self.compute_dtype in _LOW_DTYPES

    def override_table(self) -> dict[str, Target | None]:
        """The op table of `rules` with `overrides` for `compute_dtype` (a policy that casts by op, with overrides)."""
        return _OVERRIDE_TABLES[(self.rules, self.compute_dtype, self.overrides)]

    @property
    def effective_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: `reduce_dtype`, or `param_dtype` when that is None."""
        return self.param_dtype if self.reduce_dtype is None else self.reduce_dtype

    def cast_to_param(self, tree: Tree) -> Tree:
        """Casts the floating-point tensor leaves of `tree` to `param_dtype`."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Tree) -> Tree:
        """Casts the floating-point tensor leaves of `tree` to `compute_dtype`."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Tree) -> Tree:
        """Casts the floating-point tensor leaves of `tree` to `output_dtype`."""
        return cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, dtype: torch.dtype) -> Policy:
        """Returns a copy of this policy with `param_dtype` replaced."""
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: torch.dtype) -> Policy:
        """Returns a copy of this policy with `compute_dtype` replaced."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: torch.dtype) -> Policy:
        """Returns a copy of this policy with `output_dtype` replaced."""
        return dataclasses.replace(self, output_dtype=dtype)

    def with_reduce_dtype(self, dtype: torch.dtype | None) -> Policy:
        """Returns a copy of this policy with `reduce_dtype` replaced (None: follow `param_dtype`)."""
        return dataclasses.replace(self, reduce_dtype=dtype)

    def with_rules(self, rules: str | None) -> Policy:
        """Returns a copy of this policy with `rules` replaced ("cuda", "cpu" or None)."""
        return dataclasses.replace(self, rules=rules)

    def with_overrides(self, overrides: Mapping[Any, Cast | torch.dtype | None]) -> Policy:
        """Returns a copy of this policy with `overrides` in place of its per-op changes of `rules`.

        E.g. `policy.with_overrides({"scaled_dot_product_attention": torch.float32})` keeps
        attention in float32 under torch's CPU rules (see the tuning guide).

        Args:
            overrides: Op (a torch function, its name such as "layer_norm", or its path such as
                "torch.fft.rfft") -> a `fmp.autocast.Cast`, torch.float32 (`Cast.FLOAT32`), or None
                for no cast. An empty mapping removes them.

        Returns:
            The new policy.

        Raises:
            TypeError: If `overrides` is not a mapping or a value is another dtype (use `Cast.LOWER`
                for the compute dtype) or not a Cast.
            ValueError: For an op no torch function has the name of, an in-place op, or a policy
                with `rules=None`.
        """
        if not isinstance(overrides, Mapping):
            raise TypeError(f"Policy.with_overrides takes a mapping of op to rule, got {type(overrides).__name__}")
        return dataclasses.replace(self, overrides=_checked_overrides(overrides))

    def __str__(self) -> str:
        spec = (
            f"params={_dtype_name(self.param_dtype)},"
            f"compute={_dtype_name(self.compute_dtype)},"
            f"output={_dtype_name(self.output_dtype)}"
        )
        # Only a reduce dtype that was set is written, so that a policy following params parses back equal.
        if self.reduce_dtype is not None:
            spec += f",reduce={_dtype_name(self.reduce_dtype)}"
        if self.rules != _DEFAULT_RULES:
            spec += f",rules={str(self.rules).lower()}"
        if self.overrides:
            spec += ",overrides=" + "+".join(f"{name}:{_rule_name(rule)}" for name, rule in self.overrides)
        return spec


def _pairs(overrides: Any) -> list[tuple[Any, Any]]:
    """`overrides` as a list of pairs, or a ValueError naming what it is instead."""
    if not isinstance(overrides, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in overrides):
        raise ValueError(f"Policy.overrides must be a tuple of (op name, Cast or None) pairs, got {overrides!r}")
    return list(overrides)


def _checked_overrides(overrides: Mapping[Any, Any]) -> tuple[tuple[str, Cast | None], ...]:
    """Overrides keyed by op name, float32 spelled `Cast.FLOAT32`, sorted: a policy's hashable form."""
    checked: dict[str, Cast | None] = {}
    for op, rule in overrides.items():
        if rule is torch.float32:
            rule = Cast.FLOAT32
        if rule is not None and not isinstance(rule, Cast):
            raise TypeError(
                f"a Policy's override is a fmp.autocast.Cast, torch.float32 or None, got {rule!r} for {op!r}; "
                f"Cast.LOWER casts to the compute dtype, and fmp.autocast.autocast takes other dtypes"
            )
        name = checked_override(op, rule)
        if name in checked:
            raise ValueError(f"Policy overrides name {name!r} twice")
        checked[name] = rule
    return tuple(sorted(checked.items()))


def _rule_name(rule: Cast | None) -> str:
    return "none" if rule is None else rule.value


def get_policy(spec: str, *, device_type: str | torch.device | None = None) -> Policy:
    """Parses a policy string such as "params=float32,compute=bfloat16,output=float32".

    The grammar is jmp's: comma-separated `key=dtype` pairs with keys `params`/`p`,
    `compute`/`c` and `output`/`o`, plus fmp's `reduce`/`r` (the data-parallel gradient reduction,
    see `Policy.reduce_dtype`) and `rules` ("cuda", "cpu" or "none", see `Policy.rules`). Unset
    keys default as: params float32, compute follows params, output follows compute, reduce follows
    params (None, also spelled "reduce=none"), rules "cuda". `overrides` lists per-op changes of the
    rules as `op:rule` joined by "+" (`overrides=scaled_dot_product_attention:float32`; rules
    "lower", "float32", "promote", "float32_unless_float16" or "none"; see
    `Policy.with_overrides`; op names are case-sensitive). A bare dtype ("bf16") sets params,
    compute and output. Dtypes are spelled as in torch or jmp (float32, fp32, f32, full, float16,
    fp16, f16, bfloat16, bf16, float64, f64, ...) and "half" is the platform's 16-bit float (see
    `half_dtype`). Case and whitespace do not matter.
    `get_policy(str(policy)) == policy` for every policy.

    Args:
        spec: The policy string.
        device_type: The device type "half" resolves for; None means the current accelerator.

    Returns:
        The parsed Policy.

    Raises:
        TypeError: If `spec` is not a string, or an override names a module or class.
        ValueError: Naming the bad key, dtype or fragment and what is accepted.
    """
    if not isinstance(spec, str):
        raise TypeError(f"get_policy takes a string, got {type(spec).__name__}")
    if not spec.strip():
        raise ValueError("empty policy string; expected e.g. 'params=float32,compute=bfloat16,output=float32'")
    if "=" not in spec:
        dtype = _parse_dtype(spec, device_type)
        return Policy(dtype, dtype, dtype)
    chosen: dict[str, torch.dtype] = {}
    rules: str | None = _DEFAULT_RULES
    overrides: dict[str, Cast | None] = {}
    seen: set[str] = set()
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise ValueError(f"malformed policy fragment {part.strip()!r} in {spec!r}; expected key=dtype")
        if key not in _KEYS and key not in ("rules", "overrides"):
            accepted = ", ".join([*_KEYS, "rules", "overrides"])
            raise ValueError(f"unknown policy key {key!r} in {spec!r}; accepted: {accepted}")
        field = _KEYS.get(key, key)
        if field in seen:
            raise ValueError(f"policy key for {field} given twice in {spec!r}")
        seen.add(field)
        if field == "rules":
            rules = _parse_rules(value)
        elif field == "overrides":
            overrides = _parse_overrides(value)
        elif field == "reduce_dtype" and value.strip().lower() == "none":
            continue  # spelled out: the reduction follows the params, the default
        else:
            chosen[field] = _parse_dtype(value, device_type)
    param = chosen.get("param_dtype", torch.float32)
    compute = chosen.get("compute_dtype", param)
    policy = Policy(param, compute, chosen.get("output_dtype", compute), chosen.get("reduce_dtype"), rules)
    return policy.with_overrides(overrides) if overrides else policy


def _parse_rules(value: str) -> str | None:
    name = value.strip().lower()
    if name == "none":
        return None
    if name not in RULE_SETS:
        raise ValueError(f"unknown autocast rules {value.strip()!r}; accepted: {', '.join([*RULE_SETS, 'none'])}")
    return name


def _parse_overrides(value: str) -> dict[str, Cast | None]:
    rule_names = {rule.value: rule for rule in Cast} | {"none": None}
    parsed: dict[str, Cast | None] = {}
    for item in value.split("+"):
        op, sep, rule = item.rpartition(":")  # the last colon: "aten::mm:none"
        op, rule = op.strip(), rule.strip().lower()
        if not sep or not op or rule not in rule_names:
            raise ValueError(
                f"malformed policy override {item.strip()!r}; expected op:rule with rule one of {', '.join(rule_names)}"
            )
        if op in parsed:
            raise ValueError(f"policy overrides name {op!r} twice")
        parsed[op] = rule_names[rule]
    return parsed
