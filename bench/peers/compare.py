#!/usr/bin/env python3
"""PyTorch's torch.distributed.pipelining against `hp train`, side by side.

Run inside the Debian 13 root (LibTorch 2.6 for hp, python3-torch 2.6 for
PyTorch), from the repository root:

    bash scripts/debian13.sh setup --with-python
    bash scripts/debian13.sh run -- python3 bench/peers/compare.py --rounds 3

For each setting, `hp peers export` writes the model's initial parameters and
every (step, microbatch) batch once; then, in each round, every schedule pair
runs PyTorch's schedule (bench/peers/torch_pipelining.py) and hp's, one after
the other (which one goes first alternates by round), on 2 ranks pinned to
cores 0 and 1 with one intra-op thread each. The step time is the median over
rounds of each run's median step (the first step is excluded as warm-up). The
losses of every step must agree to a relative 1e-4. See bench/peers/README.md.
"""
import argparse
import json
import shutil
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SETTINGS = {
    "compute": dict(layers=8, d_model=128, heads=4, seq_len=64, microbatch_size=4,
                    microbatches=8),
    "overhead": dict(layers=4, d_model=32, heads=4, seq_len=16, microbatch_size=1,
                     microbatches=32),
}

# (PyTorch schedule, hp schedule, hp chunks per rank, note)
PAIRS = [
    ("GPipe", "gpipe", 1, ""),
    ("1F1B", "1f1b", 1, ""),
    ("Interleaved1F1B", "interleaved-1f1b", 2, ""),
    ("LoopedBFS", "interleaved-bfs", 2, ""),
    ("InterleavedZeroBubble", "interleaved-zb", 2, ""),
    ("ZBVZeroBubble", "zbv", 2, ""),
]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def run(cmd, timeout):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout


def last_error(out):
    lines = [l for l in out.splitlines() if l.strip()]
    for l in lines:
        if "error" in l.lower():
            return l.strip()[:200]
    return (lines[-1] if lines else "no output")[:200]


def cpu_busy(seconds=1.0):
    """Share of all cores busy over `seconds` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit_s, threshold=0.15):
    """Waits up to limit_s for the machine to be idle (other load disturbs the
    pinned ranks); returns the busy share seen last."""
    deadline = time.monotonic() + limit_s
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


SPIN = ("import os\n"
        "os.sched_setaffinity(0, {%d})\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "while True:\n"
        "    pass\n")


class AwakeCores:
    """One SCHED_IDLE busy loop pinned to each rank's core while a run lasts.

    On this VM a core that went idle sometimes wakes for a message only at the
    next timer tick (4 ms): a Gloo round trip on loopback has a median of
    0.3 ms but a 90th percentile of 4 ms between idle cores, 0.33 ms when
    each core has such a loop. The loops run only when nothing else can, so
    they take no time from the ranks; they keep the cores from idling."""

    def __init__(self, cores):
        self.cores, self.procs = cores, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN % c]) for c in self.cores]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def model_args(s):
    return ["--model", "gpt", "--layers", str(s["layers"]), "--d-model", str(s["d_model"]),
            "--heads", str(s["heads"]), "--seq-len", str(s["seq_len"]), "--untied"]


def run_theirs(a, setting, export, name, out):
    cmd = [sys.executable, os.path.join(HERE, "torch_pipelining.py"), "--export", export,
           "--schedule", name, "--out", out, "--nproc", str(a.nproc), "--lr", str(a.lr),
           "--weight-decay", str(a.weight_decay), "--runtime", a.their_runtime,
           "--timeout", str(a.timeout)]
    rc, text = run(cmd, a.timeout + 30)
    if rc != 0:
        return {"error": last_error(text)}
    with open(out) as f:
        j = json.load(f)
    busy = j["busy_seconds"][-1]
    return {"steps": j["step_seconds"], "losses": j["losses"], "busy": busy,
            "kernel": j["kernel_seconds"][-1],
            "makespan": j["makespan_seconds"][-1], "runtime": j.get("runtime", ""),
            "pipeline": j["pipeline_seconds"]}


def run_ours(a, setting, name, chunks, out):
    s = SETTINGS[setting]
    cmd = [a.hp, "train", "--pin", "--no-progress", *model_args(s), "-p", str(a.nproc),
           "-s", name, "-m", str(s["microbatches"]), "--microbatch-size",
           str(s["microbatch_size"]), "--steps", str(a.steps), "--seed", str(a.seed),
           "--lr", str(a.lr), "--weight-decay", str(a.weight_decay), "--dtype", "float32",
           "--report", out, "--p2p", a.hp_p2p]
    if chunks > 1:
        cmd += ["-v", str(chunks)]
    rc, text = run(cmd, a.timeout + 30)
    if rc != 0:
        return {"error": last_error(text)}
    with open(out) as f:
        j = json.load(f)
    ranks = j["ranks"]
    return {"steps": j["step_seconds"], "losses": j["loss"],
            "busy": [r["compute_seconds"] for r in ranks],
            "comm_wait": [r["comm_wait_seconds"] for r in ranks],
            "overhead": [r["overhead_seconds"] for r in ranks],
            "makespan": j["measured_makespan_seconds"]}


def step_median(r):
    steps = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    return median(steps)


def idle_share(r, key="busy"):
    """1 - busiest rank's compute / the step's compute makespan (last step)."""
    if key not in r:
        return float("nan")
    return 1.0 - max(r[key]) / r["makespan"] if r["makespan"] > 0 else float("nan")


def max_rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def fmt_ms(x):
    return f"{x * 1e3:.1f}" if x == x else "-"


def render(a, settings, pairs, results, load_before, load_after):
    """The tables (markdown) and the JSON summary of `results`:
    {setting: {"theirs": {name: [run]}, "ours": {(name, chunks): [run]}}}."""
    lines = []
    summary = {"load_before": load_before, "load_after": load_after, "settings": {},
               "args": {"awake_cores": a.awake_cores, "hp_p2p": a.hp_p2p, "rounds": a.rounds, "steps": a.steps,
                        "nproc": a.nproc, "lr": a.lr, "weight_decay": a.weight_decay,
                        "seed": a.seed}}
    for setting in settings:
        s = SETTINGS[setting]
        lines.append(f"\n**{setting}**{' (cores kept awake)' if a.awake_cores else ''}"
                     f"{', hp point-to-point over shared memory' if a.hp_p2p == 'shm' else ''}: "
                     f"gpt, {s['layers']} layers, d_model {s['d_model']}, "
                     f"{s['heads']} heads, seq {s['seq_len']}, {s['microbatches']} microbatches of "
                     f"{s['microbatch_size']}, {a.nproc} ranks, {a.steps} steps x {a.rounds} "
                     "rounds\n")
        lines.append("| PyTorch schedule | hp schedule | PyTorch step ms | hp step ms | "
                     "PyTorch / hp (per-round range) | losses agree (max rel. diff) | "
                     "PyTorch idle (calls / kernels) | hp idle | hp comm wait / overhead |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        rows = []
        for theirs, ours, chunks, note in pairs:
            slot = {"theirs": results[setting]["theirs"][theirs],
                    "ours": results[setting]["ours"][(ours, chunks)]}
            ok_t = [r for r in slot["theirs"] if "error" not in r]
            ok_o = [r for r in slot["ours"] if "error" not in r]
            ours_name = ours + (f" (v {chunks})" if chunks > 1 and ours != "zbv" else "")
            if note:
                ours_name += " \\*"
            t_ms = median([step_median(r) for r in ok_t])
            o_ms = median([step_median(r) for r in ok_o])
            if ok_t and ok_o:
                diffs = [max_rel_diff(rt["losses"], ro["losses"]) for rt in ok_t for ro in ok_o]
                worst = max(diffs)
                agree = ("yes" if worst <= a.tolerance else "**NO**") + f" ({worst:.1e})"
            else:
                worst, agree = None, "-"
            t_idle = median([idle_share(r) for r in ok_t])
            t_idle_k = median([idle_share(r, "kernel") for r in ok_t])
            o_idle = median([idle_share(r) for r in ok_o])
            o_wait = median([max(r["comm_wait"]) for r in ok_o])
            o_over = median([max(r["overhead"]) for r in ok_o])
            runtime = ok_t[0]["runtime"] if ok_t else ""
            label = theirs + (" (action runtime)" if runtime == "ir" else "")
            err_t = next((r["error"] for r in slot["theirs"] if "error" in r), "")
            err_o = next((r["error"] for r in slot["ours"] if "error" in r), "")
            ratio = t_ms / o_ms if ok_t and ok_o else float("nan")
            # The machine's speed drifts between rounds; each round's pair ran back to back.
            per_round = [step_median(rt) / step_median(ro)
                         for rt, ro in zip(slot["theirs"], slot["ours"])
                         if "error" not in rt and "error" not in ro]
            spread = f" ({min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
            lines.append(
                f"| {label} | {ours_name} | {fmt_ms(t_ms) if ok_t else 'failed'} | "
                f"{fmt_ms(o_ms) if ok_o else 'failed'} | "
                f"{ratio:.2f}{spread} | {agree} | "
                f"{100 * t_idle:.1f} / {100 * t_idle_k:.1f} % | {100 * o_idle:.1f} % | "
                f"{fmt_ms(o_wait)} / {fmt_ms(o_over)} ms |"
                if ok_t and ok_o else
                f"| {label} | {ours_name} | {fmt_ms(t_ms) if ok_t else 'failed: ' + err_t} | "
                f"{fmt_ms(o_ms) if ok_o else 'failed: ' + err_o} | - | - | - | - | - |")
            rows.append({"theirs": theirs, "ours": ours, "chunks": chunks, "runtime": runtime,
                         "theirs_step_s": t_ms, "ours_step_s": o_ms, "ratio": ratio,
                         "max_loss_rel_diff": worst, "per_round_ratios": per_round,
                         "theirs_idle": t_idle, "theirs_idle_kernels": t_idle_k,
                         "ours_idle": o_idle,
                         "theirs_runs": slot["theirs"], "ours_runs": slot["ours"]})
        summary["settings"][setting] = {"spec": s, "rows": rows}
    notes = [p[3] for p in pairs if p[3] and p[3] != "see above"]
    if notes:
        lines.append("")
        lines.extend(f"\\* {n}." for n in notes)
    all_runs = [r for st in results.values() for side in st.values() for rs in side.values()
                for r in rs]
    noisy = sum(1 for r in all_runs if r["busy_before"] > 0.15)
    lines.append(f"\nload average before / after: {' '.join(load_before)} / "
                 f"{' '.join(load_after)}; {noisy} of {len(all_runs)} runs started while the "
                 "machine was more than 15 % busy")
    return "\n".join(lines) + "\n", summary


def results_from_json(path):
    """Rebuilds (settings, pairs, results, loads, rounds, steps) from --json output."""
    with open(path) as f:
        summary = json.load(f)
    settings, results, seen = [], {}, []
    rounds = steps = 0
    for setting, st in summary["settings"].items():
        settings.append(setting)
        runs = {"theirs": {}, "ours": {}}
        for row in st["rows"]:
            runs["theirs"][row["theirs"]] = row["theirs_runs"]
            runs["ours"][(row["ours"], row["chunks"])] = row["ours_runs"]
            if (row["theirs"], row["ours"], row["chunks"]) not in seen:
                seen.append((row["theirs"], row["ours"], row["chunks"]))
            rounds = max(rounds, len(row["ours_runs"]))
            for r in row["ours_runs"]:
                steps = max(steps, len(r.get("steps", [])))
        results[setting] = runs
    pairs = [p for p in PAIRS if p[:3] in seen]
    return (settings, pairs, results, summary["load_before"], summary["load_after"], rounds,
            steps, summary.get("args", {}).get("awake_cores", False))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--settings", default="compute,overhead",
                    help="comma separated: " + ", ".join(SETTINGS))
    ap.add_argument("--schedules", default="",
                    help="comma separated PyTorch schedule names (default: all)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative difference of a step's loss")
    ap.add_argument("--their-runtime", default="auto", choices=["auto", "class", "ir"],
                    help="see torch_pipelining.py --runtime")
    ap.add_argument("--hp", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                 "build-debian13", "tools", "hp", "hp"))
    ap.add_argument("--quiet-wait", type=float, default=0,
                    help="before each run, wait up to this many seconds for the machine's "
                         "cores to be under 15 %% busy (other load disturbs pinned ranks)")
    ap.add_argument("--awake-cores", action="store_true",
                    help="keep the ranks' cores from idling during each run (a SCHED_IDLE busy "
                         "loop per core; see AwakeCores)")
    ap.add_argument("--hp-p2p", default="gloo", choices=["gloo", "shm"],
                    help="hp's point-to-point transport between the ranks (hp train --p2p); "
                         "PyTorch's is always Gloo")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json", default="", help="write every measurement here")
    ap.add_argument("--markdown", default="", help="write the tables here too")
    ap.add_argument("--keep", action="store_true", help="keep the exports and run reports")
    ap.add_argument("--render", default="", help="only print the tables of an earlier --json")
    a = ap.parse_args()
    if a.render:
        settings, pairs, results, lb, la, a.rounds, a.steps, a.awake_cores = \
            results_from_json(a.render)
        with open(a.render) as f:
            a.hp_p2p = json.load(f).get("args", {}).get("hp_p2p", "gloo")
        text, _ = render(a, settings, pairs, results, lb, la)
        print(text)
        return 0

    pairs = PAIRS
    if a.schedules:
        want = a.schedules.split(",")
        pairs = [p for p in PAIRS if p[0] in want]
    settings = a.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"unknown setting {s}; use {', '.join(SETTINGS)}")
    if not os.access(a.hp, os.X_OK):
        raise SystemExit(f"{a.hp}: not built (scripts/debian13.sh run -- bash -c "
                         "'HP_BUILD_DIR=build-debian13 bash scripts/build.sh')")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]

    tmp = tempfile.mkdtemp(prefix="hp-peers-")
    results = {}
    for setting in settings:
        s = SETTINGS[setting]
        export = os.path.join(tmp, setting)
        rc, text = run([a.hp, "peers", "export", *model_args(s), "-m", str(s["microbatches"]),
                        "--microbatch-size", str(s["microbatch_size"]), "--steps",
                        str(a.steps), "--seed", str(a.seed), "--out", export], 600)
        if rc != 0:
            raise SystemExit("hp peers export failed:\n" + text)
        print(f"[{setting}] {text.strip()}", file=sys.stderr)
        # Runs by side and key: theirs by PyTorch schedule, ours by (schedule, chunks);
        # a PyTorch schedule compared with two of ours runs once per round.
        runs = {"theirs": {}, "ours": {}}
        for rnd in range(a.rounds):
            for theirs, ours, chunks, _ in pairs:
                jobs = [("theirs", theirs), ("ours", (ours, chunks))]
                if rnd % 2 == 1:
                    jobs.reverse()
                for who, key in jobs:
                    done = runs[who].setdefault(key, [])
                    if len(done) > rnd:
                        continue
                    name = theirs if who == "theirs" else ours
                    out = os.path.join(tmp, f"{setting}-{who}-{name}-{chunks}-{rnd}.json")
                    busy = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else cpu_busy(0.2)
                    t = time.monotonic()
                    with AwakeCores(range(a.nproc) if a.awake_cores else []):
                        r = (run_theirs(a, setting, export, theirs, out) if who == "theirs"
                             else run_ours(a, setting, ours, chunks, out))
                    r["busy_before"] = busy
                    done.append(r)
                    msg = r.get("error") or f"{fmt_ms(step_median(r))} ms/step"
                    print(f"[{setting}] round {rnd + 1}/{a.rounds} {name} ({who}): {msg} "
                          f"({time.monotonic() - t:.0f} s; machine {100 * busy:.0f} % busy "
                          "before)", file=sys.stderr)
        results[setting] = runs

    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]

    text, summary = render(a, settings, pairs, results, load_before, load_after)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.keep:
        print(f"exports and reports kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    bad = [r for st in summary["settings"].values() for r in st["rows"]
           if r["max_loss_rel_diff"] is not None and r["max_loss_rel_diff"] > a.tolerance]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
