"""Every research notebook in notebooks/ runs top to bottom without a cell error.

Each notebook runs in a fresh Jupyter kernel (the venv's "python3" ipykernel) with
notebooks/ as working directory and PRECISION_NOTEBOOK_QUICK=1, which makes its first cell
pick tiny sizes. The kernel gets this process's environment minus XLA_FLAGS: every notebook
must set its own flags before JAX starts (faithful rounding; 06 also forces 8 host devices),
as it has to when a user opens it.

Time: a notebook spends most of its run starting a kernel, importing JAX and compiling,
all single-threaded, so the notebooks run two at a time (one per core of the 2-core CI
machine), longest first; one module-scoped fixture runs them all and each test reads its
notebook's result. Per-notebook wall times are printed (`pytest -s`).
"""

import asyncio
import os
import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_formats_and_swamping", "02_policies_and_audit", "03_f16_loss_scaling",
            "04_stochastic_rounding", "05_fp8_scaling", "06_zero_memory",
            "07_study_your_own_model", "08_why_did_it_diverge")
# Start order: the longest first, so the two workers finish together.
LONGEST_FIRST = ("07_study_your_own_model", "08_why_did_it_diverge", "06_zero_memory",
                 "02_policies_and_audit")
WORKERS = 2
CELL_TIMEOUT_S = 300


def _kernel_env() -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # set by conftest for this process; the notebooks set their own
  env["PRECISION_NOTEBOOK_QUICK"] = "1"
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


async def _execute(path: pathlib.Path, gate: asyncio.Semaphore) -> dict:
  async with gate:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    error = None
    try:
      await client.async_execute(env=_kernel_env())  # raises on the first failing cell
    except Exception as e:  # pylint: disable=broad-except  (reported by that notebook's test)
      error = e
    return {"nb": nb, "error": error, "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def executed() -> dict:
  order = sorted(NOTEBOOKS, key=lambda p: (p.stem not in LONGEST_FIRST,
                                           LONGEST_FIRST.index(p.stem)
                                           if p.stem in LONGEST_FIRST else 0, p.stem))

  async def run_all():
    gate = asyncio.Semaphore(WORKERS)
    results = await asyncio.gather(*(_execute(p, gate) for p in order))
    return {p.stem: r for p, r in zip(order, results)}

  start = time.perf_counter()
  results = asyncio.run(run_all())
  print(f"\nnotebooks: {time.perf_counter() - start:.1f} s wall, {WORKERS} at a time; " +
        ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in sorted(results.items())))
  return results


def test_every_expected_notebook_is_present():
  assert tuple(p.stem for p in NOTEBOOKS) == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_clean_and_quick_aware(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in code), \
      f"{path.name} is committed with outputs; clear them"
  first = code[0].source
  assert "PRECISION_NOTEBOOK_QUICK" in first and "enable_faithful_rounding()" in first
  assert first.index("enable_faithful_rounding()") < first.index("import jax\n")


# Slow (CI runs the slow set after the fast one): the eight kernels take about three
# minutes of this 2-core machine.
@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes(name, executed):
  result = executed[name]
  if result["error"] is not None:
    raise result["error"]  # nbclient's CellExecutionError names the cell and its traceback
  nb = result["nb"]
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  # Every notebook tells its story with at least one figure; an inline backend that was
  # switched off (e.g. to Agg) would silently drop them.
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} drew no figure"
  setup = next(c for c in nb.cells if c.cell_type == "code")
  first_output = "".join(o.get("text", "") for o in setup.outputs)
  assert "QUICK=True" in first_output and "faithful rounding True" in first_output
