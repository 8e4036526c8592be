"""`--defer-wgrad auto`, side by side in one run: `hp train --fb-overlap` on the
same schedule with the W's never deferred (`--defer-wgrad=off`), always
(`--defer-wgrad`), and as the run chooses after its second step (the
default: NOTE [The deferred W's chosen in the run] in
hp/pipeline/pipeline.cpp), under modelled links (`--link LATENCY_US,GBPS`) and
over loopback. The variants alternate within each round; each row gives the
medians over rounds of the runs' median step time, the ratios to `off`, how
often `auto` chose the deferred W's with the gain it predicted (the median
of 1 - with / without), and the measured peak activations of `on` against
`off` (the most over ranks, last step).

    .venv/bin/python bench/python/bench_defer_auto.py --model moe --links loopback,1000,1
    .venv/bin/python bench/python/bench_defer_auto.py --model gpt --nproc 2 --links 1000,1

--links is read two at a time (LATENCY_US,GBPS); the word `loopback` stands
alone. Needs the `hp` tool (build/tools/hp/hp, or --hp).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overlap import parse_links, run_arguments  # noqa: E402

MODES = {"off": ["--defer-wgrad=off"], "on": ["--defer-wgrad"], "auto": []}


def run_once(args, link, mode, report):
    cmd = [args.hp, "train", "--model", args.model, "--nproc", str(args.nproc),
           "--schedule", args.schedule, "--microbatches", str(args.microbatches),
           "--steps", str(args.steps), "--pin", "--no-progress", "--fb-overlap",
           "--report", report] + MODES[mode]
    if args.model == "moe":
        cmd += ["--ep", str(args.ep)]
    if link:
        cmd += ["--link", link]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_defer_auto: {' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    with open(report) as f:
        return json.load(f)


def main():
    args = run_arguments(__doc__, 1, 10, "loopback,1000,1").parse_args()
    if not os.access(args.hp, os.X_OK):
        sys.exit(f"bench_defer_auto: no hp tool at {args.hp} (bash scripts/build.sh, or --hp)")
    if args.rounds < 1 or args.steps < 3:
        sys.exit("bench_defer_auto: --rounds >= 1 and --steps >= 3 (auto chooses after step 2)")
    print("| link | off: step | on / off | auto / off | auto chose on | predicted gain "
          "| peak activations, on / off |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        for link in parse_links(args.links):
            steps = {m: [] for m in MODES}
            peaks = {m: [] for m in MODES}
            chose, gains = 0, []
            order = list(MODES)
            for r in range(args.rounds):
                for mode in (order if r % 2 == 0 else order[::-1]):
                    j = run_once(args, link, mode, report)
                    steps[mode].append(j["median_step_seconds"])
                    peaks[mode].append(max(k.get("peak_activation_bytes", 0.0)
                                           for k in j["ranks"]))
                    if mode == "auto":
                        a = j["defer_wgrad_auto"]
                        chose += bool(a["deferred"])
                        p = a["predicted_step_seconds"]
                        gains.append(1 - p["with"] / p["without"])
                print(f"  {link or 'loopback'}: round {r + 1}/{args.rounds}", file=sys.stderr)
            med = {m: statistics.median(v) for m, v in steps.items()}
            peak = statistics.median(peaks["on"]) / max(statistics.median(peaks["off"]), 1.0)
            name = "loopback" if link is None else link.replace(",", " us, ") + " GB/s"
            print(f"| {name} | {1e3 * med['off']:.1f} ms | {med['on'] / med['off']:.2f} "
                  f"| {med['auto'] / med['off']:.2f} | {chose} of {args.rounds} "
                  f"| {100 * statistics.median(gains):.1f} % | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
