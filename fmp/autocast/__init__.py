"""Op-level autocast as a function transform: torch.autocast's precision rules, pure and composable.

`autocast(fn, dtype, rules=..., overrides=...)` runs `fn` with each listed op's floating inputs cast by its rule;
`fixed_dtype` and `no_autocast` are torch.amp's `custom_fwd` and `autocast(enabled=False)` as
transforms; `module_policies` gives chosen submodules a policy of their own. The rule sets are
plain data (`CUDA`, `CPU`, keyed by op name, each mapping to a `Cast`), in `RULE_SETS` by name.
"""

from fmp.autocast._module_policy import PolicyKey
from fmp.autocast._module_policy import module_policies
from fmp.autocast._regions import fixed_dtype
from fmp.autocast._regions import no_autocast
from fmp.autocast._rules import CPU
from fmp.autocast._rules import CUDA
from fmp.autocast._rules import RULE_SETS
from fmp.autocast._rules import Cast
from fmp.autocast._rules import RuleSet
from fmp.autocast._transform import autocast

__all__ = [
    "CPU",
    "CUDA",
    "RULE_SETS",
    "Cast",
    "PolicyKey",
    "RuleSet",
    "autocast",
    "fixed_dtype",
    "module_policies",
    "no_autocast",
]
