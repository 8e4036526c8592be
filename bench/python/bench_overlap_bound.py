"""What the overlapped pairs could hide if every all-to-all took only its
link's time: one `hp train --fb-overlap` run's report (its fitted costs,
whose in-flight time per exchange also holds each wait for a slower
expert-parallel copy), then `hp schedule show --fb-overlap` on those costs
with every chunk's in-flight time set to each given value. Each row gives
the communication:compute ratio that makes (the stages' waits times their
in-flight time, over F + I + W), the predicted share of the pairs' waits
hidden (NOTE [What a pair hides, predicted] in hp/schedule/simulate.cpp)
and the predicted step, then both with `--defer-wgrad --pair-turns ready
--w-parts N` (NOTE [Weight gradients until the message is there] in
hp/pipeline/overlap.cpp); the first row is the run's own costs.

    .venv/bin/python bench/python/bench_overlap_bound.py --link 1000,1 --inflight 1.2,0.7,0.5

--inflight is in milliseconds. Needs the `hp` tool (build/tools/hp/hp, or --hp).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def show(args, costs, extra):
    cmd = [args.hp, "schedule", "show", args.schedule, "-p", str(args.nproc), "-m",
           str(args.microbatches), "--fb-overlap", "--costs", costs] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    share = re.search(r"pairs' waits\s+([0-9.]+) % hidden", out)
    step = re.search(r"step time\s+([0-9.e+-]+)", out)
    return (float(share.group(1)) if share else 0.0), float(step.group(1))


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hp", default=os.path.join(root, "build", "tools", "hp", "hp"))
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--schedule", default="dualpipev")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--link", default="1000,1", help="LATENCY_US,GBPS of the run")
    ap.add_argument("--inflight", default="1.2,0.7,0.5", help="milliseconds, comma-separated")
    ap.add_argument("--w-parts", type=int, default=4, help="the deferred W's parts (last columns)")
    args = ap.parse_args()
    if not os.access(args.hp, os.X_OK):
        sys.exit(f"bench_overlap_bound: no hp tool at {args.hp} (bash scripts/build.sh, or --hp)")
    values = [float(v) * 1e-3 for v in args.inflight.split(",") if v.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([args.hp, "train", "--model", "moe", "--ep", str(args.ep), "--nproc",
                        str(args.nproc), "--schedule", args.schedule, "--microbatches",
                        str(args.microbatches), "--steps", str(args.steps), "--pin",
                        "--no-progress", "--fb-overlap", "--defer-wgrad=off", "--link", args.link, "--report", report],
                       capture_output=True, text=True, check=True)
        with open(report) as f:
            j = json.load(f)
        stages = j["stage_costs"]["stages"]
        compute = sum(s["f"] + s["i"] + s["w"] for s in stages)

        def ratio(costs):  # the stages' waits times their in-flight time, over the compute
            return sum(s["f_waits"] * s["f_wait"] + s["i_waits"] * s["i_wait"]
                       for s in costs) / compute

        print("| in flight per exchange | comm : compute | pairs' waits hidden, predicted "
              f"| step, predicted | W's in {args.w_parts} parts: hidden | step |")
        print("|---|---|---|---|---|---|")
        measured = ", ".join(f"{1e3 * s['f_wait']:.2f} / {1e3 * s['i_wait']:.2f} ms" for s in stages)
        rows = [(f"the run's (F / I: {measured})", report)]
        for v in values:
            for s in stages:
                s["f_wait"] = s["i_wait"] = v
            edited = os.path.join(tmp, f"edited-{v}.json")
            with open(edited, "w") as f:
                json.dump(j, f)
            rows.append((f"{1e3 * v:.2f} ms", edited))
        for name, path in rows:
            with open(path) as f:
                costs = json.load(f)["stage_costs"]["stages"]
            share, step = show(args, path, [])
            p_share, p_step = show(args, path, ["--defer-wgrad", "--pair-turns", "ready",
                                                "--w-parts", str(args.w_parts)])
            print(f"| {name} | {ratio(costs):.2f} | {share:.0f} % | {1e3 * step:.1f} ms "
                  f"| {p_share:.0f} % | {1e3 * p_step:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
