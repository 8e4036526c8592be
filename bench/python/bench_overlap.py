"""DualPipe's F&B overlap, side by side in one run: `hp train` on the same
schedule without `--fb-overlap`, with it (`--defer-wgrad=off`), with it and `--defer-wgrad` (fixed turns: one whole W per
wait), and with `--defer-wgrad --pair-turns ready --w-parts N` (W's in parts until a message is
there: NOTE [Weight gradients until the message is there] in hp/pipeline/overlap.cpp), under
modelled network links
(`--link LATENCY_US,GBPS`: NOTE [The link model] in
hp/distributed/link_model.cpp) and over plain loopback. The variants
alternate within each round; each row gives the medians over rounds of the
runs' median step time, their ratios to the plain one, and, from the overlapped run's report,
the share of its pairs' waits on communication that the partner's compute
hid (hidden / (hidden + exposed), summed over ranks; lowest-highest over the
rounds): copy 0's, the simulator's for copy 0's fitted costs (NOTE
[What a pair hides, predicted] in hp/schedule/simulate.cpp), and with
experts the busiest copy's, whose compute sets the step (the other copies
also wait for its experts: NOTE [The copies' compute] in
hp/train/report.cpp), beside the copies' compute spread (most / least, the
overlapped run's last step).

    .venv/bin/python bench/python/bench_overlap.py --links loopback,1000,1,3000,0.2

--links is a comma-separated list read two at a time (LATENCY_US,GBPS),
where the word `loopback` stands alone for no link. Needs the `hp` tool
(build/tools/hp/hp, or --hp).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def parse_links(text):
    parts = [p.strip() for p in text.split(",") if p.strip()]
    links, i = [], 0
    while i < len(parts):
        if parts[i] == "loopback":
            links.append(None)
            i += 1
            continue
        if i + 1 >= len(parts):
            sys.exit(f"bench_overlap: --links: '{parts[i]}' has no GBPS after it")
        links.append(f"{parts[i]},{parts[i + 1]}")
        i += 2
    if not links:
        sys.exit("bench_overlap: --links names no link")
    return links


def run_once(args, link, overlap, report, defer=False, ready=False):
    cmd = [args.hp, "train", "--model", args.model, "--nproc", str(args.nproc),
           "--schedule", args.schedule,
           "--microbatches", str(args.microbatches), "--steps", str(args.steps),
           "--pin", "--no-progress", "--report", report]
    if args.model == "moe":
        cmd += ["--ep", str(args.ep), "--capacity-factor", str(args.capacity_factor)]
    if link:
        cmd += ["--link", link]
    if overlap:
        cmd += ["--fb-overlap", "--defer-wgrad" if defer else "--defer-wgrad=off"]
    if ready:
        cmd += ["--pair-turns", "ready", "--w-parts", str(args.w_parts)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_overlap: {' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    with open(report) as f:
        j = json.load(f)
    hidden = sum(r.get("pair_hidden_comm_seconds", 0.0) for r in j["ranks"])
    exposed = sum(r.get("pair_exposed_comm_seconds", 0.0) for r in j["ranks"])
    # The busiest copy of each stage rank (NOTE [The copies' compute]).
    busy_hidden = busy_exposed = 0.0
    spread = 1.0
    for r in j["ranks"]:
        compute = r.get("copies_compute_seconds")
        if not compute or "copies_pair_hidden_comm_seconds" not in r:
            continue
        d = max(range(len(compute)), key=compute.__getitem__)
        busy_hidden += r["copies_pair_hidden_comm_seconds"][d]
        busy_exposed += r["copies_pair_exposed_comm_seconds"][d]
        spread = max(spread, max(compute) / max(min(compute), 1e-12))
    busiest = busy_hidden / (busy_hidden + busy_exposed) if busy_hidden + busy_exposed > 0 else None
    ph = sum(r.get("predicted_pair_hidden_comm_seconds", 0.0) for r in j["ranks"])
    pe = sum(r.get("predicted_pair_exposed_comm_seconds", 0.0) for r in j["ranks"])
    predicted = ph / (ph + pe) if ph + pe > 0 else None
    return j["median_step_seconds"], hidden, exposed, busiest, spread, predicted


def run_arguments(doc, nproc, steps, links):
    """The options of an `hp train` run that the overlap benchmarks share."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--hp", default=os.path.join(root, "build", "tools", "hp", "hp"))
    ap.add_argument("--model", choices=["moe", "gpt"], default="moe")
    ap.add_argument("--ep", type=int, default=2, help="--model moe: expert-parallel copies")
    ap.add_argument("--nproc", type=int, default=nproc, help="pipeline ranks (each copy's)")
    ap.add_argument("--schedule", default="dualpipev")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--links", default=links)
    return ap


def main():
    ap = run_arguments(__doc__, 2, 6, "loopback,1000,1,3000,0.2")
    ap.add_argument("--capacity-factor", type=float, default=0.0,
                    help="--model moe: hp train's (0: dropless; 1: no expert takes more than an "
                         "even share from a rank, which bounds the copies' load spread)")
    ap.add_argument("--w-parts", type=int, default=4,
                    help="the last variant's --w-parts (each deferred W in N parts)")
    args = ap.parse_args()
    if not os.access(args.hp, os.X_OK):
        sys.exit(f"bench_overlap: no hp tool at {args.hp} (bash scripts/build.sh, or --hp)")
    if args.rounds < 1 or args.steps < 2 or args.microbatches < 1:
        sys.exit("bench_overlap: --rounds >= 1, --steps >= 2 and --microbatches >= 1")
    links = parse_links(args.links)
    print("| link | off: step | --fb-overlap: step | on / off | pairs' waits hidden "
          "| predicted | on the busiest copy | copies' compute, most / least "
          "| + --defer-wgrad: step | / off "
          f"| + --defer-wgrad --pair-turns ready --w-parts {args.w_parts}: step | / off | hidden "
          "| on the busiest copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        for link in links:
            off, on, deferred, share, busiest, spread, predicted = [], [], [], [], [], [], []
            parts, parts_share, parts_busiest = [], [], []
            variants = [(False, False, False), (True, False, False), (True, True, False),
                        (True, True, True)]
            for r in range(args.rounds):
                for overlap, defer, ready in (variants if r % 2 == 0 else variants[::-1]):
                    step, hidden, exposed, busy, sp, pred = run_once(args, link, overlap, report,
                                                                     defer, ready)
                    if ready:
                        parts.append(step)
                        if hidden + exposed > 0:
                            parts_share.append(hidden / (hidden + exposed))
                        if busy is not None:
                            parts_busiest.append(busy)
                        continue
                    (deferred if defer else on if overlap else off).append(step)
                    if overlap and not defer and hidden + exposed > 0:
                        share.append(hidden / (hidden + exposed))
                        spread.append(sp)
                        if pred is not None:
                            predicted.append(pred)
                        if busy is not None:
                            busiest.append(busy)
                print(f"  {link or 'loopback'}: round {r + 1}/{args.rounds}", file=sys.stderr)
            a, b, c = statistics.median(off), statistics.median(on), statistics.median(deferred)
            d = statistics.median(parts)
            def pct(xs):
                return f"{100 * min(xs):.0f}-{100 * max(xs):.0f} %" if xs else "-"

            hid, pred, busy = pct(share), pct(predicted), pct(busiest)
            sp = f"{min(spread):.2f}-{max(spread):.2f}" if busiest else "-"
            name = "loopback" if link is None else link.replace(",", " us, ") + " GB/s"
            print(f"| {name} | {1e3 * a:.1f} ms | {1e3 * b:.1f} ms | {b / a:.2f} | {hid} "
                  f"| {pred} | {busy} | {sp} | {1e3 * c:.1f} ms | {c / a:.2f} "
                  f"| {1e3 * d:.1f} ms | {d / a:.2f} | {pct(parts_share)} | {pct(parts_busiest)} |",
                  flush=True)


if __name__ == "__main__":
    main()
