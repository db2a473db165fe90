"""PrecisionReport: what a traced function computes in which dtype, and `check(policy)`."""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
from typing import Any, Mapping

import numpy as np

from precision import _plan
from precision import _overrides
from precision._dtypes import below_f32 as _below_f32
from precision._dtypes import is_float as _is_float
from precision._policy import Policy
from precision.audit import _format
from precision.audit._format import short_dtype as _short
from precision.audit._walk import ConvertRecord, GemmRecord, OpRecord

_F32 = np.dtype(np.float32)


class PrecisionViolation(ValueError):
  """Raised by PrecisionReport.check; `.violations` lists one line per offending op."""

  def __init__(self, violations: list[str]):
    self.violations = list(violations)
    super().__init__(f"{len(violations)} precision violation(s):\n  " + "\n  ".join(violations))


def _path_rules(rules) -> tuple:
  return tuple(r for r in rules if isinstance(r.key, str))


def governing_policy(policy: Policy, rules, gemm) -> Policy:
  """The policy a GEMM record is checked against: that of the override autocast applies
  at its scope and direction (`_overrides.governing`; path patterns only), else
  `policy`."""
  rule = _overrides.match_scope(_path_rules(rules), gemm.scope, {},
                                "bwd" if gemm.direction == "bwd" else "fwd")
  return policy if rule is None else rule.policy


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """Every GEMM, reduction, transcendental and convert of a traced function, with dtypes.

  Attributes:
    name: the function's name.
    gemms: GemmRecord per dot_general / convolution / grouped GEMM (forward and
      backward; a grouped GEMM, `lax.ragged_dot`, is one record with its group count and
      role: fwd, dlhs or drhs).
    ops: OpRecord per reduction and transcendental (exp, log, ...).
    converts: ConvertRecord per convert_element_type.
    bytes_by_dtype: bytes of all intermediate values by dtype name (an upper bound on
      activation memory: before XLA fusion and buffer reuse).
    has_while: a while loop was walked once (its trip count is unknown to the jaxpr).
    opaque: OpaqueRecord per kernel call (Pallas) whose numerics the policy does not
      govern: reported, with its operand dtypes, instead of passing unseen (`check`
      does not fail on it: the kernel's dtypes are its author's).
  """

  name: str
  gemms: tuple[GemmRecord, ...]
  ops: tuple[OpRecord, ...]
  converts: tuple[ConvertRecord, ...]
  bytes_by_dtype: Mapping[str, int]
  has_while: bool = False
  opaque: tuple = ()

  # --------------------------------------------------------------------- summaries
  @property
  def flops(self) -> int:
    """Total GEMM FLOPs (2 per multiply-add) per call."""
    return sum(g.flops for g in self.gemms)

  @property
  def num_gemms(self) -> int:
    return sum(g.count for g in self.gemms)

  def gemm_signatures(self, direction: str | None = None) -> collections.Counter:
    """Counter of (lhs, rhs, acc, out) short dtype names over GEMMs (optionally fwd/bwd)."""
    return collections.Counter(
        (_short(g.lhs_dtype), _short(g.rhs_dtype), _short(g.acc_dtype), _short(g.out_dtype))
        for g in self.gemms if direction in (None, g.direction) for _ in range(g.count))

  def gemms_in_scope(self, pattern: str) -> list[GemmRecord]:
    """GEMMs whose scope (module path) matches an fnmatch pattern."""
    return [g for g in self.gemms if fnmatch.fnmatchcase(g.scope, pattern)]

  def grouped_gemms(self, role: str | None = None) -> list[GemmRecord]:
    """The grouped GEMMs (`lax.ragged_dot`: an MoE layer's experts), optionally of one
    role: "fwd", "dlhs" (the tokens' gradient) or "drhs" (the experts' weights')."""
    return [g for g in self.gemms if g.groups and role in (None, g.role)]

  def convert_counts(self) -> collections.Counter:
    return collections.Counter(
        (_short(c.from_dtype), _short(c.to_dtype)) for c in self.converts for _ in range(c.count))

  def island_dtypes(self) -> dict[str, set[str]]:
    """{op name: dtypes its reductions/transcendentals ran in} for ops that come from
    precision.ops, flax norm layers or jax.nn functions."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for o in self.ops:
      if o.op:
        out[o.op].add(_short(o.dtype))
    return dict(out)

  # --------------------------------------------------------------------- check
  def violations(self, policy: Any,
                 overrides: Mapping[Any, Policy | str] | None = None) -> list[str]:
    """The list `check` raises with (empty when the function follows the policy)."""
    # A recipe, a preset name or a Plan is bound once; a policy gives a spec alone.
    plan = (_plan.as_plan(policy, overrides)
            if isinstance(policy, _plan.Plan) or _plan.is_recipe(policy) else None)
    spec = plan.autocast_spec if plan is not None else _plan.spec_for(policy, overrides)
    policy, rules = spec.policy, spec.rules
    allowed_anywhere = {np.dtype(r.policy.compute_dtype).name for r in rules
                        if not isinstance(r.key, str)}
    found = []
    for g in self.gemms:
      groups = f" ({g.grouped})" if g.groups else ""
      where = (f"{g.direction} {g.primitive}{groups} {g.shape} at {g.location or '?'} "
               f"[{g.scope}]")
      if _below_f32(g.acc_dtype) and _is_float(g.acc_dtype):
        found.append(f"GEMM accumulates in {_short(g.acc_dtype)} (< f32): {where}")
      if g.is_fp8:
        continue  # fp8 GEMMs are the fp8 recipe's choice; only their accumulation is checked
      compute = np.dtype(governing_policy(policy, rules, g).compute_dtype).name
      ok = {compute} | allowed_anywhere
      if g.lhs_dtype not in ok or g.rhs_dtype not in ok:
        found.append(
            f"GEMM operands {_short(g.lhs_dtype)} x {_short(g.rhs_dtype)}, expected "
            f"{_short(compute)}: {where}")
    found.extend(self._fp8_violations(plan))
    for o in self.ops:
      if o.kind == "accumulating" and _is_float(o.dtype) and _below_f32(o.dtype):
        found.append(f"{o.primitive} accumulates in {_short(o.dtype)} (< f32): {o.direction} "
                     f"at {o.location or '?'} [{o.scope}] {o.op}")
    return found

  def _fp8_violations(self, plan: Any) -> list[str]:
    """For a recipe with per-tensor fp8 GEMMs (not microscaled): forward fp8 GEMMs in
    the forward format on both operands, backward ones with the gradient in the backward
    format against a forward-format operand, and a differentiated program with forward
    fp8 GEMMs has backward fp8 GEMMs (not compute-dtype ones: a gradient traced inside
    the autocast function would give those)."""
    if plan is None:  # a policy: no fp8 GEMMs
      return []
    want8 = plan.gemms  # the GEMM dtypes bind decided
    if want8.fwd8 is None:  # no fp8, or microscaled
      return []
    fwd, bwd, name = want8.fwd8, want8.bwd8, want8.recipe_name
    found, n = [], collections.Counter()
    for g in self.gemms:
      if not g.is_fp8:
        continue
      n[g.direction] += 1
      want = (fwd, fwd) if g.direction == "fwd" else tuple(sorted((fwd, bwd)))
      got = (g.lhs_dtype, g.rhs_dtype)
      got = got if g.direction == "fwd" else tuple(sorted(got))
      if got != want:
        found.append(f"fp8 {g.direction} GEMM operands {_short(g.lhs_dtype)} x "
                     f"{_short(g.rhs_dtype)}, expected {' x '.join(_short(w) for w in want)} "
                     f"(recipe {name}): {g.primitive}"
                     f"{f' ({g.grouped})' if g.groups else ''} {g.shape} at "
                     f"{g.location or '?'} [{g.scope}]")
    has_bwd = any(g.direction == "bwd" for g in self.gemms)
    if n["fwd"] and has_bwd and not n["bwd"]:
      ran = sorted({_short(d) for g in self.gemms if g.direction == "bwd"
                    for d in (g.lhs_dtype, g.rhs_dtype)})
      found.append(f"recipe {name}: {n['fwd']} forward fp8 GEMM(s) but no backward "
                   f"fp8 GEMM (the backward GEMMs run in {'/'.join(ran)}, not with the "
                   f"{_short(bwd)} gradients the recipe asks for)")
    return found

  def check(self, policy: Any,
            overrides: Mapping[Any, Policy | str] | None = None) -> "PrecisionReport":
    """Raises PrecisionViolation (a ValueError) listing every GEMM whose operands are not in
    the policy's compute dtype (outside `overrides`, whose path patterns govern each
    GEMM's scope by autocast's own rule: the deepest enclosing scope a pattern matches,
    the first such pattern given; type keys allow their compute dtype anywhere), every GEMM
    accumulating below f32, and every accumulating reduction (sum, cumsum, scatter-add,
    psum) below f32. fp8 GEMMs are accepted when they accumulate in f32. Returns self.

    Args:
      policy: a Policy or policy string; a Recipe or preset name (its policy); or a Plan
        (`precision.bind`: its policy and overrides, so pass no `overrides` besides).
      overrides: {path pattern or module type: policy}.

    Examples:
      >>> precision.audit.audit(grad_fn, model, batch).check(plan)
    """
    found = self.violations(policy, overrides)
    if found:
      raise PrecisionViolation(found)
    return self

  # --------------------------------------------------------------------- printing
  def table(self, max_rows: int = 40) -> str:
    return _format.gemm_table(self, max_rows)

  def precision_map(self) -> str:
    return _format.precision_map(self)

  def __str__(self) -> str:
    return self.table() + "\n\n" + self.precision_map()
