#!/usr/bin/env python3
"""One `hp train` run, two builds of `hp`, taking turns: the median step of
each from its --report, and their ratio per round (B over A, above 1: A is
faster), so that the host's drift between rounds cancels out. For a change's
cost on the step: build the commit before it into another folder, then

    .venv/bin/python bench/paired_binaries.py OLD/tools/hp/hp build/tools/hp/hp \\
        --rounds 6 -- -p 2 --schedule 1f1b --steps 30 --pin --no-progress

Everything after `--` goes to both `hp train`s (a --report of its own is
added). Prints each round and the median ratio with the middle half of the
rounds (25th to 75th percentile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def median_step(binary: str, args, report: str) -> float:
    cmd = [binary, "train", *args, "--report", report]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(report) as f:
        return float(json.load(f)["median_step_seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the first hp binary (e.g. the build before a change)")
    ap.add_argument("b", help="the second hp binary")
    ap.add_argument("--rounds", type=int, default=6)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    # Everything after `--` is hp train's (argparse's REMAINDER after the two
    # positionals would take the options of this script too).
    a = ap.parse_args(argv[:cut])
    args = argv[cut + 1:]
    ratios, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        for r in range(a.rounds):
            # Who goes first alternates with the round.
            order = [("a", a.a), ("b", a.b)] if r % 2 == 0 else [("b", a.b), ("a", a.a)]
            got = {k: median_step(path, args, report) for k, path in order}
            ratios.append(got["b"] / got["a"])
            rows.append(got)
            print(f"round {r}: a {got['a'] * 1e3:.2f} ms, b {got['b'] * 1e3:.2f} ms, "
                  f"b / a {ratios[-1]:.3f}", flush=True)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    print(f"median step: a {statistics.median(x['a'] for x in rows) * 1e3:.2f} ms, "
          f"b {statistics.median(x['b'] for x in rows) * 1e3:.2f} ms; b / a median "
          f"{statistics.median(ratios):.3f} (middle half {q[0]:.3f}-{q[2]:.3f}) over "
          f"{a.rounds} rounds")


if __name__ == "__main__":
    main()
