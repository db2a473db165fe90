"""Override rules: another policy for part of a program, and the one rule that matches them.

`overrides` maps a path pattern (fnmatch on a "/"-joined module path or name scope such as
"blocks/0/mlp", e.g. "*lm_head*") or a module type to another policy (a Policy or a policy
string). An op belongs to the scope it was traced in (NNX module paths, Linen module names,
`jax.named_scope`s); the deepest enclosing scope that some rule matches decides, and among
the rules matching that scope the first one given wins. An op no rule matches follows the
base policy, so an override on a block covers every layer inside it.

A value may also be a mapping {"fwd": policy, "bwd": policy} (either key may be left
out): a direction-specific override. "bwd" gives the compute dtype of the scope's
backward GEMMs (the two gradient GEMMs of each forward GEMM, and the GEMMs of a traced
program's own backward pass); "fwd" gives the policy of everything else in the scope (its
forward GEMMs, f32 ops, elementwise ops, param and output dtypes). Only GEMMs have a
direction the override can choose: the backward of a non-GEMM op is JAX's transpose of the
forward op and runs in the dtypes the forward chose. A direction the mapping leaves out
falls through to the enclosing rule (or the base policy), as if the rule were absent for
it. Of a "bwd" policy only the compute dtype is used.

`governing` is that rule, the only one: autocast's interpreter, the NNX and Linen policies
(params cast by module path) and `precision.audit`'s `check` all ask it which override
governs an op, so a check cannot disagree with what ran. A rule that governs nothing is a
typo until shown otherwise: `match_counts` counts the scopes each rule governs (Qwix
reports the same per rule) and `unmatched_message` names the closest scopes.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Iterable, Mapping, NamedTuple

from precision._policy import Policy, get_policy


DIRECTIONS = ("fwd", "bwd")


class Rule(NamedTuple):
  """One override: `key` gives `policy` to the ops of `direction` ("both", "fwd" or
  "bwd"; a {"fwd": .., "bwd": ..} value becomes one Rule per key given)."""
  key: str | type
  policy: Policy
  direction: str = "both"

  def covers(self, direction: str) -> bool:
    return self.direction in ("both", direction)


def parse_overrides(overrides: Mapping[Any, Any] | None,
                    module_base: type | tuple[type, ...] = object) -> tuple[Rule, ...]:
  """Validates `overrides` and parses every policy.

  Raises:
    ValueError: naming a key that is neither a non-empty pattern string nor a module type,
      or a policy string that does not parse.
  """
  if overrides is None:
    return ()
  if not isinstance(overrides, Mapping):
    raise ValueError(
        f"overrides must be a mapping {{pattern or module type: policy}}, got {overrides!r}")
  rules = []
  for key, value in overrides.items():
    if isinstance(key, str):
      if not key.strip():
        raise ValueError(
            f"Empty override pattern {key!r}; expected an fnmatch pattern on module paths "
            "such as '*lm_head*' or 'blocks/0/*'")
    elif not (isinstance(key, type) and issubclass(key, module_base)):
      raise ValueError(
          f"Override key {key!r} is neither a path pattern (str) nor a module type "
          f"(subclass of {module_base})")
    if isinstance(value, Mapping):
      rules.extend(_directional(key, value))
      continue
    try:
      policy = get_policy(value)
    except ValueError as e:
      raise ValueError(f"Override {key!r}: bad policy {value!r}: {e}") from e
    rules.append(Rule(key, policy))
  return tuple(rules)


def _directional(key, value: Mapping) -> list[Rule]:
  """The rules of a {"fwd": policy, "bwd": policy} override value, "fwd" first."""
  accepted = 'a mapping with key "fwd" and/or "bwd", each a policy'
  unknown = [k for k in value if k not in DIRECTIONS]
  if unknown or not value:
    what = f"unknown key(s) {unknown!r}" if unknown else "no key"
    raise ValueError(f"Override {key!r}: {dict(value)!r} has {what}; accepted: a policy, "
                     f"or {accepted} (e.g. {{'bwd': 'p=f32,c=f32,o=f32'}})")
  out = []
  for d in DIRECTIONS:
    if d in value:
      try:
        out.append(Rule(key, get_policy(value[d]), d))
      except ValueError as e:
        raise ValueError(f"Override {key!r}: bad {d!r} policy {value[d]!r} in "
                         f"{dict(value)!r} ({accepted}): {e}") from e
  return out


def is_directional(rules: Iterable[Rule]) -> bool:
  """Whether some rule gives a policy to one direction only."""
  return any(r.direction != "both" for r in rules)


def as_mapping(rules: Iterable[Rule]) -> dict:
  """{key: Policy, or {"fwd": Policy, "bwd": Policy} for a direction-specific key}, in
  the order given: the overrides the rules were parsed from, policies parsed."""
  out: dict = {}
  for r in rules:
    if r.direction == "both":
      out[r.key] = r.policy
    else:
      out.setdefault(r.key, {})[r.direction] = r.policy
  return out


def describe_value(value) -> str:
  """An override value of `as_mapping` as one line shows it: 'p=f32,c=f32,o=f32' or
  {'bwd': 'p=f32,c=f32,o=f32'}."""
  if isinstance(value, Mapping):
    return "{" + ", ".join(f"{d!r}: {str(p)!r}" for d, p in value.items()) + "}"
  return repr(str(value))


def match(rules: Iterable[Rule], path: str, module: Any,
          direction: str | None = None) -> Rule | None:
  """The first rule (covering `direction`; None: any rule) whose pattern matches `path` or
  whose type `module` is an instance of."""
  for rule in rules:
    if direction is not None and not rule.covers(direction):
      continue
    if isinstance(rule.key, str):
      if fnmatch.fnmatchcase(path, rule.key):
        return rule
    elif module is not None and isinstance(module, rule.key):
      return rule
  return None


class UnmatchedOverrideWarning(UserWarning):
  """An override pattern matched no module path of the model it was applied to. It may
  still name a `jax.named_scope` of the model's code (checked at the first call, an
  error there if it matches no scope either); filter this category for such patterns."""


def check_all_matched(rules: Iterable[Rule], matched: set, paths: list[str]) -> None:
  """Raises ValueError naming every rule that matched no module (a typo in a pattern)."""
  unmatched = [r.key for r in rules if r.key not in matched]
  if unmatched:
    raise ValueError(unmatched_message(unmatched, paths, "matched no module",
                                       "module paths"))


def match_counts(rules: Iterable[Rule], scopes: Iterable[str],
                 module_at: Mapping[str, Any] | None = None) -> dict:
  """{rule key: how many of `scopes` it governs (in either direction)}, every key of
  `rules` present, in the order given."""
  rules = tuple(rules)
  counts = {r.key: 0 for r in rules}
  for scope in scopes:
    keys = {g.rule.key for g in (governing(rules, scope, module_at, d) for d in DIRECTIONS)
            if g.rule is not None}
    for key in keys:
      counts[key] += 1
  return counts


def closest(key: str | type, names: Iterable[str], n: int = 3) -> list[str]:
  """Up to `n` of `names` closest to pattern `key` (its wildcards ignored), by whole name
  or last component ("blocks/0/lm_head" is close to "lm_haed")."""
  if not isinstance(key, str):
    return []
  stem = key.replace("*", "").replace("?", "").strip("/")
  names = list(dict.fromkeys(names))
  by_last = {}
  for name in names:
    by_last.setdefault(name.rsplit("/", 1)[-1], name)
  found = difflib.get_close_matches(stem, names, n, 0.6)
  found += [by_last[m] for m in difflib.get_close_matches(stem, list(by_last), n, 0.6)]
  return list(dict.fromkeys(found))[:n]


def unmatched_message(unmatched: Iterable, names: list[str], what: str, kind: str,
                      counts: Mapping | None = None) -> str:
  """The message naming each unmatched key, the scopes or paths there are (`kind`), the
  names closest to each key, and (given `match_counts`) every rule's count."""
  unmatched = list(dict.fromkeys(unmatched))
  shown = ", ".join(repr(p) for p in names[:16]) + (", ..." if len(names) > 16 else "")
  keys = ", ".join(key_name(k) for k in unmatched)
  near = "; ".join(f"closest to {key_name(k)}: {', '.join(repr(c) for c in found)}"
                   for k in unmatched if (found := closest(k, names)))
  per_rule = ("" if counts is None else "; per rule, how many it governs: " + ", ".join(
      f"{key_name(k)}: {c}" for k, c in counts.items()))
  return (f"Override(s) {keys} {what}; {kind} are: "
          f"{shown or '(none: the function opens no named scope or module)'}"
          + (f"; {near}" if near else "") + per_rule)


def key_name(key: str | type) -> str:
  """An override key as error messages show it: a pattern quoted, a type by its name."""
  return repr(key) if isinstance(key, str) else key.__name__


def scope_prefixes(scope: str) -> list[str]:
  """"a/b/c" -> ["a/b/c", "a/b", "a"] (deepest first); "" -> []."""
  parts = [p for p in scope.split("/") if p]
  return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


class Governing(NamedTuple):
  """What governs the ops of one direction in one scope: `rule` (None: no rule) and the
  policy they take (`rule.policy`, a marked module's policy, or None: the base)."""
  rule: Rule | None
  policy: Policy | None


def governing(rules: Iterable[Rule], scope: str, module_at: Mapping[str, Any] | None = None,
              direction: str = "fwd",
              module_policy: Mapping[str, Policy] | None = None) -> Governing:
  """The override governing an op of `direction` traced in `scope`: the deepest prefix of
  `scope` that a rule covering `direction` matches (by pattern, or by the type of the
  module recorded at that prefix in `module_at`), among the rules matching it the first;
  a prefix with a policy of its own in `module_policy` (a submodule marked separately)
  and no rule governs with that policy."""
  rules = tuple(rules)
  if not rules and not module_policy:
    return Governing(None, None)
  module_at = module_at or {}
  for prefix in scope_prefixes(scope):
    rule = match(rules, prefix, module_at.get(prefix), direction)
    if rule is not None:
      return Governing(rule, rule.policy)
    if module_policy and prefix in module_policy:
      return Governing(None, module_policy[prefix])
  return Governing(None, None)


def match_scope(rules: Iterable[Rule], scope: str, module_at: Mapping[str, Any],
                direction: str = "fwd") -> Rule | None:
  """The rule `governing` finds for an op of `direction` in `scope` (None: no rule)."""
  return governing(rules, scope, module_at, direction).rule
