"""`fused_adamw`: the fused AdamW + stochastic-rounding kernel as an optax transformation.

`precision.rounding.FusedAdamW` computes the new 16-bit params in one pass (the Pallas
kernel on a GPU, its XLA reference elsewhere). As a GradientTransformation it hands them
through updates the way `stochastic_updates` does: the update of each leaf is the f32
delta ``f32(new) - f32(old)`` between two param-dtype values, and
`precision.optim.apply_updates` turns it back into exactly `new` (see
`precision.optim._apply`: exact except for a -0.0 target, f16 subnormal targets and a
weight shrinking 2**12 (f16) / 2**15 (bf16) fold or more in one step, the same cases as
every rounding transform of this package). A recipe with ``fused=True`` selects it in
`build_optimizer`, inside the recipe's guard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
import jax.numpy as jnp
import optax

from precision.optim import _apply
from precision.optim import _seed
from precision.optim import _compat
from precision.optim import _tree
from precision.rounding import FusedAdamW
from precision.rounding import FusedAdamWState



@dataclasses.dataclass(frozen=True)
class _Spec:
  opt: FusedAdamW
  seed_given: bool
  keep_master_given: bool
  axis_name_given: bool


def fused_adamw(learning_rate: float | Callable[[jax.Array], jax.Array],
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                eps_root: float = 0.0, weight_decay: float = 1e-4, mask: Any = None, *,
                seed: int | None = None, keep_master: bool | None = None,
                impl: str = "auto", block_size: int | None = None,
                interpret: bool | None = None, axis_name: str | None = None
                ) -> optax.GradientTransformation:
  """AdamW with stochastic rounding into bf16/f16 params, one fused pass per leaf.

  The arithmetic is optax.adamw's with `learning_rate`, `b1`, `b2`, `eps`, `eps_root`,
  `weight_decay`, followed by ``stochastic_round(w + u, param dtype, key=leaf_seed(seed,
  i), step=count)``: bit for bit ``stochastic_updates(optax.adamw(..., mask=m), seed)``
  (the ``bf16_sr`` recipe), or with ``keep_master=True`` ``master_weights(optax.adamw(...),
  rounding="stochastic", seed=seed)``. Moments (and the master) are f32.

  Args:
    learning_rate: float, or an optax schedule ``count -> lr``.
    b1, b2, eps, eps_root, weight_decay: optax.adamw's (weight_decay a Python float).
    mask: weight-decay mask. None is llm.c's rule (decay leaves with ndim >= 2, not
      biases and norm gains), NOT optax.adamw's None (decay everything); or a pytree of
      bools like the params, or ``params -> pytree of bools``.
    seed: seed of the stochastic rounding. None: build_optimizer's `seed` (0 standalone).
    keep_master: keep an f32 master copy. None: the recipe's master_dtype in
      build_optimizer (False standalone).
    impl: "auto" (Pallas on a GPU, the XLA reference elsewhere), "xla" or "pallas".
    block_size: elements per Pallas program (None: the kernel's default).
    interpret: the Pallas mode (`FusedAdamW.interpret`).
    axis_name: set when `update` runs on ZeRO shards (see `FusedAdamW`; needs an explicit
      `mask`). build_optimizer passes its own.

  Returns:
    An optax.GradientTransformation on bf16/f16 params (`update` refuses f32 params;
    `init` also takes their f32 master values). Its updates are f32 deltas: apply them
    with `precision.optim.apply_updates`. Its state is a
    `precision.rounding.FusedAdamWState`.

  Examples:
    >>> recipe = precision.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)
    >>> tx = precision.optim.build_optimizer(recipe, fused_adamw(3e-4, weight_decay=0.1))
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = precision.optim.apply_updates(params, updates)
  """
  if isinstance(learning_rate, bool) or not (
      callable(learning_rate) or isinstance(learning_rate, (int, float, np.floating))):
    raise ValueError(f"fused_adamw: learning_rate={learning_rate!r}; accepted: a float or "
                     "an optax schedule (count -> lr)")
  if seed is not None:
    _seed.check_seed(seed)
  kwargs = {} if block_size is None else {"block_size": block_size}
  opt = FusedAdamW(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   weight_decay=weight_decay, mask=mask, seed=0 if seed is None else seed,
                   keep_master=bool(keep_master), impl=impl, interpret=interpret,
                   axis_name=axis_name, **kwargs)
  return _register(_Spec(opt, seed is not None, keep_master is not None,
                         axis_name is not None))


class FusedAdamWTransformation(_compat.Own):
  """A `fused_adamw` transformation. Its update takes ``apply=`` (a bool scalar: the
  guard's skip happens inside the fused pass, which the guard prefers to selecting after
  it), and `spec` holds its FusedAdamW and which of seed, keep_master and axis_name were
  given explicitly, so that `build_optimizer` recognises it and binds the rest (None
  once bound). The
  capability is the type (as optax's `GradientTransformationExtraArgs`), not a registry."""

  def __new__(cls, init, update, spec: "_Spec | None"):
    tx = super().__new__(cls, init, update)
    tx.spec = spec  # an attribute of this instance (a tuple subclass with a __dict__)
    return tx

  def __getnewargs__(self):
    return (self.init, self.update, self.spec)


def _register(spec: _Spec) -> optax.GradientTransformation:
  return _transform(spec.opt, spec)


def _transform(opt: FusedAdamW, spec: "_Spec | None") -> optax.GradientTransformation:
  def init_fn(params):
    # Float leaves of any dtype: f32 moments shaped like them, and the master their f32
    # values. So a state can be built on an f32 master (precision.checkpoint converts a
    # run into a fused recipe that way); `update` takes bf16/f16 params only.
    bad = [p.dtype for p in jax.tree.leaves(params) if not jnp.issubdtype(p.dtype, jnp.floating)]
    if bad:
      raise ValueError(f"fused_adamw: a {bad[0]} leaf among the params; accepted: float "
                       "leaves (bf16/f16 params, or their f32 master values for init)")
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params) if opt.keep_master else None
    return FusedAdamWState(jnp.zeros((), jnp.int32), zeros, zeros, master)

  def update_fn(grads, state, params=None, *, apply=None):
    # apply: the guard's bool scalar (see `takes_apply`); a skip happens inside the fused
    # pass, the state unchanged and the updates -0.0.
    if params is None:
      raise ValueError("fused_adamw needs params in update(grads, state, params)")
    new_params, state = opt.update(grads, state, params, apply=apply)
    # Every leaf is bf16/f16 (FusedAdamW refuses others), so `deltas` never falls back to
    # its third argument: each update is f32(new) - f32(old).
    updates = _apply.deltas(new_params, params, new_params)
    if apply is not None:
      updates = _tree.skip_updates(apply, updates)
    return updates, state

  # FusedAdamW runs under strict promotion (it scopes standard promotion where optax does).
  return FusedAdamWTransformation(init_fn, update_fn, spec)


def takes_apply(tx: Any) -> bool:
  """Whether `tx.update` takes ``apply=`` (a `fused_adamw` transformation)."""
  return isinstance(tx, FusedAdamWTransformation)


def is_fused_adamw(tx: Any) -> bool:
  """Whether `tx` was built by `fused_adamw` (and not yet bound by `build_optimizer`)."""
  return isinstance(tx, FusedAdamWTransformation) and tx.spec is not None


def bind_to_recipe(tx: optax.GradientTransformation, recipe_name: str, keep_master: bool,
                   seed: int, axis_name: str | None) -> optax.GradientTransformation:
  """`tx` (from `fused_adamw`) with build_optimizer's seed and axis_name and the recipe's
  master; each one `fused_adamw` was given explicitly must agree."""
  spec = tx.spec
  opt = spec.opt
  clashes = []
  if spec.seed_given and opt.seed != seed:
    clashes.append(f"fused_adamw(seed={opt.seed}) but build_optimizer(seed={seed})")
  if spec.keep_master_given and opt.keep_master != keep_master:
    clashes.append(f"fused_adamw(keep_master={opt.keep_master}) but recipe {recipe_name!r} "
                   f"{'keeps' if keep_master else 'keeps no'} f32 master")
  if spec.axis_name_given and opt.axis_name != axis_name:
    clashes.append(f"fused_adamw(axis_name={opt.axis_name!r}) but "
                   f"build_optimizer(axis_name={axis_name!r})")
  if clashes:
    raise ValueError(f"{'; '.join(clashes)}; accepted: leave them unset in fused_adamw "
                     "(build_optimizer and the recipe set them) or give equal values")
  if axis_name is not None and opt.mask is None and opt.weight_decay != 0.0:
    raise ValueError(
        f"build_optimizer(axis_name={axis_name!r}) with fused_adamw(mask=None): on ZeRO "
        "shards every leaf is flat (ndim 1), so llm.c's ndim >= 2 decay rule would decay "
        "nothing; accepted: an explicit mask (a pytree of bools like the full params) or "
        "weight_decay=0.0")
  # Bound: spec None, so build_optimizer does not take it for a user's fused_adamw again.
  return _transform(dataclasses.replace(opt, seed=seed, keep_master=keep_master,
                                        axis_name=axis_name), None)
