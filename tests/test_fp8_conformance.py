"""fp8 and microscaled recipes on models written without the library, through autocast.

A Haiku transformer (tests/_zoo.py's), an Equinox MLP (`eqx.nn.MLP`, vmapped over the
batch) and a plain-JAX function (tests/_zoo.py's residual stack under lax.scan with
jax.checkpoint) train under `fp8_hybrid` (delayed scaling, its state carried explicitly),
the same recipe with current scaling, `mxfp8` and `nvfp4`: finite losses that drop. In the
program lowered for CUDA (`jax.export`, read from its StableHLO) every GEMM the recipe
selects (`precision.fp8.autocast_gemms`) has the recipe's operands forward and backward:
E4M3 x E4M3 forward and E5M2 gradient x E4M3 backward for fp8_hybrid; for the microscaled
recipes the emulated GEMM, f32 x f32 on operands dequantised from the element format (the
StableHLO dataflow into each operand is traced back to its convert from E4M3 / E5M2 /
E2M1 and from the block-scale format); every other GEMM takes the compute dtype (bf16).
Also: the audit reads the pass of GEMMs that JAX outlines into private functions, and an
fp8 recipe on a function with integer GEMMs only is refused.
"""

import collections
import dataclasses
import functools
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision.audit import lower
from precision.audit import lowered_gemms
import _zoo


def _current():
  base = mp.get_recipe("fp8_hybrid")
  return base.replace(name="fp8_hybrid_current",
                      fp8=dataclasses.replace(base.fp8, scaling="current"))


def _mx_e5m2():
  base = mp.get_recipe("mxfp8")
  return base.replace(name="mxfp8_e5m2_grads",
                      fp8=dataclasses.replace(base.fp8, backward_format="e5m2"))


RECIPES = {"fp8_hybrid": mp.get_recipe("fp8_hybrid"), "fp8_hybrid_current": _current(),
           "mxfp8": mp.get_recipe("mxfp8"), "nvfp4": mp.get_recipe("nvfp4"),
           "mxfp8_e5m2_grads": _mx_e5m2()}
# StableHLO element types of the formats.
ELEMENT = {"e4m3": "f8E4M3FN", "e5m2": "f8E5M2", "e2m1": "f4E2M1FN"}
SCALE = {"mxfp8": "f8E8M0FNU", "nvfp4": "f8E4M3FN"}
RECOMPUTED = "rematted_computation"


class Case(NamedTuple):
  loss: Callable[..., jax.Array]   # loss(params, *args)
  params: Any
  args: tuple
  lr: float
  data_first: bool = True   # the first GEMM reads the data (not differentiated): no dgrad


def _haiku():
  hk = pytest.importorskip("haiku")
  tokens = _zoo._tokens()   # B*T = 32 rows: whole mxfp8 / nvfp4 blocks along M
  f = hk.without_apply_rng(hk.transform(_zoo._haiku_transformer_fn))
  with _zoo.user_code():
    params = f.init(jax.random.key(0), tokens[:, :-1])
  loss = lambda p, tokens: _zoo._xent(f.apply(p, tokens[:, :-1]), tokens[:, 1:])
  # The first GEMM reads the embeddings (differentiated): it has a dgrad too.
  return Case(loss, params, (tokens,), 0.2, data_first=False)


def _equinox():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(32, 32, 64, depth=3, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  x = jax.random.normal(jax.random.key(1), (32, 32))
  y = 0.5 * x[:, ::-1]

  def loss(params, x, y):
    m = eqx.combine(params, static)
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)

  return Case(loss, params, (x, y), 2.0)


def _plain():
  x = jax.random.normal(jax.random.key(6), (32, 16))
  labels = jax.random.randint(jax.random.key(7), (32,), 0, 10)
  return Case(_zoo.plain_loss, _zoo.plain_init(jax.random.key(0)), (x, labels), 0.5)


MODELS = {"haiku_transformer": _haiku, "equinox_mlp": _equinox, "plain_jax_scan_remat": _plain}
STEPS = 6


@functools.lru_cache(maxsize=None)
def _case(model):
  return MODELS[model]()


@functools.lru_cache(maxsize=None)
def _step(model, recipe):
  """(the jitted fp8 training step, its initial fp8 state, the GEMM sites)."""
  case, r = _case(model), RECIPES[recipe]
  with _zoo.user_code():
    vg = jax.jit(mp.value_and_grad(mp.autocast(case.loss, r, fp8_state=True)))
    state = mp.fp8.init_state(case.loss, r, case.params, *case.args)
    sites = mp.fp8.autocast_gemms(case.loss, r, case.params, *case.args, fp8_state=True)
  return vg, state, tuple(sites)


# ----------------------------------------------------------------------------- training

_TRAIN = [(m, r) for m in MODELS for r in ("fp8_hybrid", "fp8_hybrid_current", "mxfp8", "nvfp4")]
# Compilations over ~5 s on the shared CPU (Haiku's two-layer transformer; nvfp4's
# stochastic rounding and Hadamard transform): run with -m slow.
_SLOW_TRAIN = {("haiku_transformer", r) for r in RECIPES} | {(m, "nvfp4") for m in MODELS}


def _params(pairs, slow):
  return [pytest.param(*p, marks=pytest.mark.slow) if p in slow else p for p in pairs]


@pytest.mark.parametrize("model, recipe", _params(_TRAIN, _SLOW_TRAIN))
def test_trains_with_finite_dropping_loss(model, recipe):
  case = _case(model)
  vg, state, sites = _step(model, recipe)
  assert any(s.fp8 for s in sites), sites   # the plain model: one GEMM in a scan of 3
  params, losses = case.params, []
  with _zoo.user_code():
    for _ in range(STEPS):
      value, grads, state = vg(state, params, *case.args)
      losses.append(float(value))
      params = jax.tree.map(lambda p, g: p - case.lr * g, params, grads)
  # Finite, down at every step, and by over 5% in the few steps.
  assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0), losses
  assert losses[-1] < 0.95 * losses[0], losses
  if RECIPES[recipe].fp8.scaling == "delayed":  # the histories moved, gradients included
    for st in state.values():
      assert np.all(np.asarray(st.grad.amax_history)[..., 0] > 0)
      assert np.all(np.asarray(st.rhs.amax_history)[..., 0] > 0)


# ----------------------------------------------------------------------------- lowering


@functools.lru_cache(maxsize=None)
def _lowered(model, recipe):
  vg, state, sites = _step(model, recipe)
  case = _case(model)
  with _zoo.user_code():
    prog = lower(vg, state, case.params, *case.args, platform="cuda")
  return prog, sites


def _scope(name: str) -> str:
  """A lowered GEMM's name stack as a site scope: jvp(...)/transpose(...) unwrapped, the
  jit, platform-branch and microscaled-GEMM components dropped."""
  while True:
    inner = re.sub(r"\b(?:jvp|transpose)\(([^()]*)\)", r"\1", name)
    if inner == name:
      break
    name = inner
  skip = {"dot_general", "cond", "mxfp8_gemm", "nvfp4_gemm"}
  return "/".join(p for p in name.split("/") if p and p not in skip
                  and not p.startswith("jit(") and not re.fullmatch(r"branch_\d+_fun", p))


def _kind(gemm, recipe) -> str:
  """"fp8" (the recipe's fp8 operands for the GEMM's direction), "micro" (a microscaled
  emulated GEMM: f32 x f32 in the microscaled scope), "compute" (bf16 x bf16 -> f32) or
  the signature (anything else)."""
  fp8 = recipe.fp8
  sig = gemm.signature()
  marker = f"{fp8.scaling}_gemm"
  if re.search(rf"(^|/){marker}(/|$)", gemm.name):
    return "micro" if sig == ("f32", "f32", "f32") else str(sig)
  if sig == ("bf16", "bf16", "f32"):
    return "compute"
  if gemm.direction == "fwd" and sig == ("e4m3", "e4m3", "f32"):
    return "fp8"
  if gemm.direction == "bwd" and (tuple(sorted(sig[:2])), sig[2]) == (("e4m3", "e5m2"), "f32"):
    return "fp8"
  return str(sig)


def _formats_counter(prog, sites, recipe, by_scope, data_first):
  """(expected, found) Counters of (scope, kind, direction): each selected site one
  forward and two backward GEMMs (dgrad, wgrad) of the recipe's kind, each other site
  three compute-dtype GEMMs (a first GEMM on the data: no dgrad); remat's recomputed
  forward GEMMs (checked apart) left out."""
  kind = "micro" if recipe.fp8.scaling in ("mxfp8", "nvfp4") else "fp8"
  want = collections.Counter()
  for s in sites:
    scope = s.scope if by_scope else ""
    want[(scope, kind if s.fp8 else "compute", "fwd")] += 1
    want[(scope, kind if s.fp8 else "compute", "bwd")] += 1 if (
        data_first and s.position == 0) else 2
  got = collections.Counter(
      (_scope(g.name) if by_scope else "", _kind(g, recipe), g.direction)
      for g in prog.gemms if RECOMPUTED not in g.name)
  return want, got


# ---- the dataflow into a microscaled GEMM's operands, read from the StableHLO text

_FUNC = re.compile(r"^\s*func\.func\s+\w+\s+@(\"[^\"]*\"|[\w$.\-]+)\(")
_DEF = re.compile(r"^\s*(%[\w.\-]+)(?::\d+)?\s*=\s*(.*)$")
_USE = re.compile(r"%[\w.\-]+")
_CONVERT = re.compile(r"stablehlo\.(?:bitcast_)?convert\s+%[\w.\-]+\s*:\s*\(?tensor<([^>]*)>")
_DOT = re.compile(r"stablehlo\.dot_general\s+(%[\w.\-]+),\s*(%[\w.\-]+)")


def _operand_sources(text: str, marker: str) -> list[tuple[str, frozenset, frozenset]]:
  """For every dot_general in the `marker` scope (program order): (its line, and per
  operand the narrow element types it is converted from). Walking back from an operand
  through its defining ops, a convert / bitcast_convert from an f8/f4 type ends the walk
  (recording that type), as does another dot_general or an argument."""
  funcs, current = collections.defaultdict(dict), ""
  dots = []
  for line in text.splitlines():
    m = _FUNC.match(line)
    if m:
      current = m.group(1)
    d = _DEF.match(line)
    if d:
      funcs[current][d.group(1)] = d.group(2)
      dm = _DOT.search(d.group(2))
      if dm and marker in line:   # the op's loc is an alias; the marker checked below
        dots.append((current, line, dm.groups()))
  out = []
  for func, line, operands in dots:
    defs, per = funcs[func], []
    for v in operands:
      found, seen, todo = set(), set(), [v]
      while todo:
        u = todo.pop()
        if u in seen:
          continue
        seen.add(u)
        rhs = defs.get(u)
        if rhs is None:
          found.add("arg")
          continue
        c = _CONVERT.search(rhs)
        if c and rhs.lstrip().startswith("stablehlo."):
          element = c.group(1).split("x")[-1]
          if element.startswith(("f8", "f4")):
            found.add(element)
            continue
        if rhs.lstrip().startswith("stablehlo.dot_general"):
          found.add("gemm")
          continue
        todo.extend(_USE.findall(rhs.split(" : ")[0]))
      per.append(frozenset(found))
    out.append((line, *per))
  return out


def _micro_dots(prog, marker):
  """The dot_general lines of the microscaled GEMMs: their loc aliases resolve to names
  in the marker's scope (as precision.audit reads them)."""
  names = {g.name for g in prog.gemms if marker in g.name}
  assert names
  alias = dict(re.findall(r"^(#loc\d+)\s*=\s*loc\(\"([^\"]*)\"", prog.text, re.M))
  text = []
  for line in prog.text.splitlines():
    loc = re.search(r"loc\((#loc\d+)\)\s*$", line)
    name = alias.get(loc.group(1), "") if loc else ""
    text.append(line + (f" //{marker}" if marker in name else ""))
  return _operand_sources("\n".join(text), f"//{marker}")


_LOWER = [(m, r) for m in MODELS for r in ("fp8_hybrid", "fp8_hybrid_current", "mxfp8", "nvfp4")]
_SLOW_LOWER = {("haiku_transformer", r) for r in RECIPES}


@pytest.mark.parametrize("model, recipe", _params(_LOWER, _SLOW_LOWER))
def test_cuda_lowering_has_the_recipe_formats_forward_and_backward(model, recipe):
  r = RECIPES[recipe]
  prog, sites = _lowered(model, recipe)
  prog.check(r)   # the audit's rules (precision.audit.gemm_violations)
  by_scope = len({s.scope for s in sites}) == len(sites)   # Haiku's module names
  want, got = _formats_counter(prog, sites, r, by_scope, _case(model).data_first)
  assert got == want, (sorted(got.items()), sorted(want.items()))
  micro = r.fp8.scaling in ("mxfp8", "nvfp4")
  recomputed = [g for g in prog.gemms if RECOMPUTED in g.name]
  if model == "plain_jax_scan_remat":   # the scan's selected GEMM, recomputed by remat
    assert len(recomputed) == 1, recomputed
  for g in recomputed:   # a forward GEMM again: the forward formats
    assert _kind(g, r) == ("micro" if micro else "fp8"), g
  if micro:
    fmt, grad = ELEMENT[r.fp8.forward_format], ELEMENT[r.fp8.backward_format]
    scale = SCALE[r.fp8.scaling]
    dots = _micro_dots(prog, f"{r.fp8.scaling}_gemm")
    # One forward and two backward GEMMs per selected site, and remat's recomputations.
    assert len(dots) == 3 * sum(s.fp8 for s in sites) + len(recomputed), len(dots)
    for line, lhs, rhs in dots:
      for srcs in (lhs, rhs):   # dequantised from the element and the scale format
        narrow = {t for t in srcs if t.startswith(("f8", "f4"))}
        assert scale in srcs and srcs & {fmt, grad} and narrow <= {fmt, grad, scale}, (
            line, srcs)


def test_mxfp8_gradients_in_e5m2_reach_the_backward_gemms():
  """mxfp8 with backward_format e5m2 (the equinox MLP: its two selected GEMMs): in the
  StableHLO each forward emulated GEMM multiplies two operands dequantised from E4M3,
  each backward one a gradient dequantised from E5M2 and an operand from E4M3, every
  operand with its E8M0 block scales."""
  prog, sites = _lowered("equinox_mlp", "mxfp8_e5m2_grads")
  prog.check(RECIPES["mxfp8_e5m2_grads"])
  selected = sum(s.fp8 for s in sites)
  assert selected == 2
  e4, e5, e8 = ELEMENT["e4m3"], ELEMENT["e5m2"], SCALE["mxfp8"]
  pairs = collections.Counter()
  for line, lhs, rhs in _micro_dots(prog, "mxfp8_gemm"):
    assert e8 in lhs and e8 in rhs, line
    pairs[tuple(sorted(next(iter(s & {e4, e5})) for s in (lhs, rhs)))] += 1
    assert all(len(s & {e4, e5}) == 1 for s in (lhs, rhs)), (line, lhs, rhs)
  assert pairs == {(e4, e4): selected, (e4, e5): 2 * selected}, pairs


# ----------------------------------------------------------------------------- audit, errors


def test_audit_reads_the_pass_of_gemms_in_outlined_functions():
  """A jitted function called inside the differentiated program is lowered as a private
  function whose op names are relative to it; the audit names its GEMMs through the call
  sites, so its backward GEMMs read "bwd", and a GEMM remat recomputes in the backward
  pass reads "fwd"."""
  w1, w2, x = jnp.full((8, 8), 0.1), jnp.full((8, 8), 0.2), jnp.ones((4, 8))

  def layer(h, w):
    return jnp.tanh(h @ w)

  inner = jax.jit(layer)
  jitted = lambda ws, x: jnp.sum(inner(x @ ws[0], ws[1]))
  remat = lambda ws, x: jnp.sum(jax.checkpoint(inner)(x @ ws[0], ws[1]))
  for fn, recomputed in ((jitted, 0), (remat, 1)):
    gemms = lower(jax.grad(fn), (w1, w2), x, platform="cuda").gemms
    inside = [g for g in gemms if "jit(layer)" in g.name]
    assert [g.direction for g in inside] == ["fwd", "bwd", "bwd"], [
        (g.direction, g.name) for g in gemms]
    assert sum(RECOMPUTED in g.name for g in inside) == recomputed
    assert all(RECOMPUTED not in g.name for g in inside if g.direction == "bwd")
  # One entry per call site: a function called twice is read twice.
  twice = lambda x, w: inner(inner(x, w), w)
  assert len(lowered_gemms(jax.export.export(jax.jit(twice), platforms=["cuda"])(
      x, w1).mlir_module())) == 2


@pytest.mark.parametrize("recipe", ["fp8_hybrid", "fp8_hybrid_current", "mxfp8"])
def test_fp8_recipe_on_integer_gemms_only_is_refused(recipe):
  a, b = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 4), jnp.int8)
  f = lambda a, b: jnp.sum(jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.int32))
  scaling = RECIPES[recipe].fp8.scaling
  with pytest.raises(ValueError, match=rf"fp8\.scaling='{scaling}'.*no GEMM of this "
                                       r"function has them.*int8 x int8 -> int32.*Accepted"):
    mp.fp8.init_state(f, RECIPES[recipe], a, b)
  if scaling != "delayed":
    with pytest.raises(ValueError, match="need floating operands"):
      mp.autocast(f, RECIPES[recipe])(a, b)
  # A float GEMM beside it: accepted (the integer one runs as written).
  g = lambda a, b, x, w: f(a, b) + jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) @ w)
  x, w = jnp.ones((4, 8)), jnp.full((8, 8), 0.1)
  sites = mp.fp8.autocast_gemms(g, RECIPES[recipe], a, b, x, w)
  assert [s.fp8 for s in sites] == [False, True, False]
  # A function without any GEMM: nothing to refuse.
  assert mp.fp8.autocast_gemms(lambda x: jnp.sum(x * 2.0), RECIPES[recipe], x) == []
