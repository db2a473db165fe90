"""Sequential seeds, simulated: `python -m experiments.bench_sequential [--quick]`.

Prints, for the rule a ``seeds="auto"`` study applies (precision.study._sequential):

1. expected seeds per recipe and for the control at true differences 0, margin and
   2 x margin, with the rates of each decision, against the fixed design (one look) of
   equal power, for both spending functions;
2. the family-wise error rates under optional stopping: any false worse/better with every
   true difference 0, any false holds-up with every true difference +-margin, with the
   noise on each run (the study's structure) and on the difference itself, for normal,
   t3 and centred lognormal noise.

Every figure is a seeded simulation (numpy), reproducible to the last digit.
"""

from __future__ import annotations

import argparse

from precision.study import _sequential as sq


def error_table(max_seeds: int, m: int, studies: int, seed: int = 5) -> str:
  p = sq.plan(max_seeds, m, margin=1.0)
  rows = ["| noise on | noise | sd/margin | false worse/better | false holds up |",
          "|---|---|---|---|---|"]
  for on in ("runs", "differences"):
    for noise in sq.NOISES:
      for sd in (0.5, 1.0, 4.0):
        r = sq.error_rates(p, sd, noise, studies=studies, seed=seed, on=on)
        rows.append(f"| {on} | {noise} | {sd:g} | {r['false_difference']:.4f} | "
                    f"{r['false_holds']:.4f} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="2,000 studies per row, not 20,000")
  ap.add_argument("--max-seeds", type=int, default=12)
  ap.add_argument("--m", type=int, default=3, help="recipes in the family")
  args = ap.parse_args(argv)
  studies = 2000 if args.quick else 20_000
  print(f"Looks {sq.looks(args.max_seeds)}, m = {args.m}, alpha = {sq.ALPHA}; "
        "normal differences, every recipe at the same true difference; "
        f"{min(studies, 4000)} studies per row.\n")
  print(sq.expected_seeds_table(args.max_seeds, args.m, sd_over_margin=(0.1, 0.25, 0.5, 1.0),
                                studies=min(studies, 4000)))
  print(f"\nFamily-wise error rates (linear spending, the default), {studies} studies per row "
        f"(binomial s.e. at 0.05: {(0.05 * 0.95 / studies) ** 0.5:.4f}).\n")
  print(error_table(args.max_seeds, args.m, studies))


if __name__ == "__main__":
  main()
