"""Stochastic-rounding benchmark: `python -m experiments.bench_rounding [--quick]`.

Prints, in one run: the XLA stochastic cast f32 -> bf16 over a plain `astype` (nearest) at
16M elements, and the fused AdamW + stochastic-rounding update over the unfused
precision.optim path (stochastic_updates around optax.adamw), both as medians of repeats.
On a GPU it also prints the Pallas kernels' achieved bandwidth as a fraction of the peak.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import precision as mp
from precision.rounding import FusedAdamW
from precision.rounding import llmc_decay_mask
from precision.rounding import stochastic_round
from precision.rounding import stochastic_round_pallas
from experiments.timing import median_seconds

# HBM peak bytes/s by device kind (vendor datasheets), for the GPU bandwidth fraction.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def run(quick: bool = False) -> dict:
  """Returns the figures (seconds and ratios); `quick` uses 1M elements and fewer repeats."""
  n = 1 << 20 if quick else 1 << 24
  repeats = 3 if quick else 7
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  nearest = jax.jit(lambda x: x.astype(jnp.bfloat16))
  sr = jax.jit(lambda x: stochastic_round(x, jnp.bfloat16, 0, 1, impl="xla"))
  t_near, t_sr = median_seconds(nearest, x, repeats=repeats), median_seconds(sr, x, repeats=repeats)

  params = {"w": jnp.zeros((n // 1024, 1024), jnp.bfloat16)}
  grads = {"w": jax.random.normal(jax.random.key(1), (n // 1024, 1024), jnp.bfloat16)}
  tx = mp.optim.stochastic_updates(
      optax.adamw(1e-3, weight_decay=0.1, mask=llmc_decay_mask(params)), seed=0)
  fused = FusedAdamW(1e-3, weight_decay=0.1, seed=0)

  @jax.jit
  def unfused_step(p, s, g):
    u, s = tx.update(g, s, p)
    return mp.optim.apply_updates(p, u), s

  fused_step = jax.jit(lambda p, s, g: fused.update(g, s, p))
  t_unfused = median_seconds(unfused_step, params, tx.init(params), grads, repeats=repeats)
  t_fused = median_seconds(fused_step, params, fused.init(params), grads, repeats=repeats)
  out = {"elements": n, "backend": jax.default_backend(),
         "astype_s": t_near, "sr_xla_s": t_sr, "sr_over_astype": t_sr / t_near,
         "unfused_adamw_s": t_unfused, "fused_adamw_s": t_fused,
         "fused_over_unfused": t_fused / t_unfused, "pallas_bandwidth_fraction": None}
  if jax.default_backend() == "gpu":
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in kind), None)
    kernel = jax.jit(lambda x: stochastic_round_pallas(x, jnp.bfloat16, 0, 1))
    t_pallas = median_seconds(kernel, x, repeats=repeats)
    achieved = n * (4 + 2) / t_pallas  # read f32, write bf16
    out.update(pallas_sr_s=t_pallas, pallas_bytes_per_s=achieved, device_kind=kind,
               pallas_bandwidth_fraction=None if peak is None else achieved / peak)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--quick", action="store_true")
  r = run(ap.parse_args(argv).quick)
  print(f"backend {r['backend']}, {r['elements']:,} elements")
  print(f"stochastic cast (XLA) / astype(bf16): {r['sr_xla_s'] * 1e3:.2f} ms / "
        f"{r['astype_s'] * 1e3:.2f} ms = {r['sr_over_astype']:.2f}x")
  print(f"fused AdamW+SR / unfused (stochastic_updates(optax.adamw)): "
        f"{r['fused_adamw_s'] * 1e3:.2f} ms / {r['unfused_adamw_s'] * 1e3:.2f} ms = "
        f"{r['fused_over_unfused']:.2f}x")
  if "pallas_sr_s" in r:
    frac = r["pallas_bandwidth_fraction"]
    print(f"Pallas stochastic cast: {r['pallas_bytes_per_s'] / 1e9:.0f} GB/s on "
          f"{r['device_kind']}" + ("" if frac is None else f" = {frac:.2f} of peak"))
  else:
    print("Pallas achieved bandwidth: not measured (no GPU on this machine; the kernels "
          "run only in interpret mode here)")


if __name__ == "__main__":
  main()
