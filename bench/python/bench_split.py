"""The dx/dw split from Python against the same split from C++, side by side.

bench/bench_split.cpp times, on a GPT-style transformer block and a wide MLP,
a fused backward and a split one (dx, then dw) of hp::autograd::GradFunction
in C++. This runs the same shapes through the Python API
(hyperparallel.forward_and_gradfn: forward in Python, then
GradFunction.compute_input_grad / compute_weight_grad, or grad_fn() fused) and
alternates, round after round, a run of the C++ binary and a run of this file's
worker, each a fresh process pinned to the same core with one thread and the
same malloc settings (NOTE [glibc malloc and page faults]). It prints, per
model, the medians and the ratios Python / C++ (the goal: the split from
Python costs at most 3 % more than from C++).

    python bench/python/bench_split.py [--rounds 3] [--core 1] [--nice -10]
                                       [--models TransformerBlock,WideMlp] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ["TransformerBlock", "WideMlp"]
MIN_TIME = 3.0  # seconds of fused backward per run, as the C++ benchmark's MinTime(3.0)
# hp::keep_freed_memory_mapped() (hp/core/memory.cpp) as glibc's environment tunables.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
              "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


# ---------------------------------------------------------------------------------------------
# The worker: one model, timed as bench_split.cpp's run() times it.
# ---------------------------------------------------------------------------------------------
def transformer_block(torch, batch=8, seq=128, d=256, heads=4):
    s = 1.0 / math.sqrt(d)

    def init(*shape, scale):
        return (torch.randn(*shape) * scale).requires_grad_(True)

    def const(fill, n):
        return torch.full((n,), fill).requires_grad_(True)

    w = [const(1.0, d), const(0.0, d), init(d, 3 * d, scale=s), const(0.0, 3 * d),
         init(d, d, scale=s), const(0.0, d), const(1.0, d), const(0.0, d),
         init(d, 4 * d, scale=s), const(0.0, 4 * d), init(4 * d, d, scale=s / 2), const(0.0, d)]
    x = torch.randn(batch, seq, d)
    hd = d // heads
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    F = torch.nn.functional

    def forward(x):
        a = F.layer_norm(x, (d,), w[0], w[1])
        q, k, v = (torch.matmul(a, w[2]) + w[3]).split(d, -1)

        def split_heads(t):
            return t.view(batch, seq, heads, hd).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        att = (q.matmul(k.transpose(-2, -1)) / math.sqrt(hd)).masked_fill(mask, -1e9)
        y = att.softmax(-1).matmul(v).transpose(1, 2).reshape(batch, seq, d)
        h = x + torch.matmul(y, w[4]) + w[5]
        f = F.layer_norm(h, (d,), w[6], w[7])
        return h + torch.matmul(F.gelu(torch.matmul(f, w[8]) + w[9]), w[10]) + w[11]

    return w, x, forward


def wide_mlp(torch, batch=256, width=1024, layers=4):
    w = []
    for _ in range(layers):
        w.append((torch.randn(width, width) / math.sqrt(width)).requires_grad_(True))
        w.append(torch.zeros(width).requires_grad_(True))
    x = torch.randn(batch, width)

    def forward(x):
        h = x
        for i in range(0, len(w), 2):
            h = torch.relu(torch.addmm(w[i + 1], h, w[i]))
        return h

    return w, x, forward


def worker(model: str, min_time: float) -> dict:
    import torch

    import hyperparallel as hp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights, inp, forward = (transformer_block if model == "TransformerBlock" else wide_mlp)(torch)
    now = time.perf_counter

    def run_forward():
        x = inp.detach().requires_grad_(True)
        return hp.forward_and_gradfn(forward, x, weights=weights)[1]

    fused, dx, dw = [], [], []
    it = 0
    while sum(fused) < min_time or it < 2:
        for order in range(2):
            gf = run_forward()
            if (order + it) % 2 == 0:
                t0 = now()
                gf()
                fused.append(now() - t0)
            else:
                t0 = now()
                gf.compute_input_grad()
                t1 = now()
                gf.compute_weight_grad()
                t2 = now()
                dx.append(t1 - t0)
                dw.append(t2 - t1)
            del gf
        run_forward()  # the C++ loop's third forward (its graph analysis), not timed
        it += 1
    split = [a + b for a, b in zip(dx, dw)]
    return {"iterations": it, "fused_ms": statistics.median(fused) * 1e3,
            "dx_ms": statistics.median(dx) * 1e3, "dw_ms": statistics.median(dw) * 1e3,
            "split_ms": statistics.median(split) * 1e3}


# ---------------------------------------------------------------------------------------------
# The driver: alternating fresh processes, pinned.
# ---------------------------------------------------------------------------------------------
def pinned(core, nice):
    """The command prefix of every run: pinned to `core`, at niceness `nice` when given."""
    return (["nice", "-n", str(nice)] if nice else []) + ["taskset", "-c", str(core)]


def run_cpp(binary, model, core, nice):
    out = subprocess.run(
        pinned(core, nice) + [binary, f"--benchmark_filter=BM_{model}$|BM_{model}/",
         "--benchmark_format=json"],
        env=dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        check=True)
    (b,) = json.loads(out.stdout)["benchmarks"]
    return {"iterations": b["iterations"], "fused_ms": b["fused_ms"], "dx_ms": b["dx_ms"],
            "dw_ms": b["dw_ms"], "split_ms": b["split_over_fused"] * b["fused_ms"]}


def run_python(model, core, nice, min_time):
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "python"),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run(
        pinned(core, nice) + [sys.executable, os.path.abspath(__file__), "--worker",
         model, "--min-time", str(min_time)],
        env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=1, help="the core every run is pinned to")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "bench", "bench_split"))
    ap.add_argument("--min-time", type=float, default=MIN_TIME)
    ap.add_argument("--nice", type=int, default=0,
                    help="run both sides at this niceness (e.g. -10 as root on a shared machine)")
    ap.add_argument("--json", help="write every run and the ratios here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.min_time)))
        return
    if not os.path.exists(args.binary):
        sys.exit(f"{args.binary} not found: build it (cmake --build build --target bench_split)")

    models = args.models.split(",")
    runs = {m: [] for m in models}
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, core "
          f"{args.core}, nice {args.nice}, one thread, {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for r in range(args.rounds):
        for m in models:
            # Alternate which side goes first, so slow drift hits both alike.
            sides = ["cpp", "py"] if (r + models.index(m)) % 2 == 0 else ["py", "cpp"]
            res = {}
            for side in sides:
                res[side] = (run_cpp(args.binary, m, args.core, args.nice) if side == "cpp"
                             else run_python(m, args.core, args.nice, args.min_time))
            runs[m].append(res)
            c, p = res["cpp"], res["py"]
            print(f"round {r} {m:16s} split C++ {c['split_ms']:8.2f} ms  Python "
                  f"{p['split_ms']:8.2f} ms  ({p['split_ms'] / c['split_ms']:.3f}x)   fused C++ "
                  f"{c['fused_ms']:8.2f}  Python {p['fused_ms']:8.2f}", flush=True)

    print()
    print(f"{'model':16s} {'C++ split ms':>12s} {'Py split ms':>12s} {'Py/C++ split':>13s} "
          f"{'Py/C++ split/fused':>19s} {'Py/C++ fused':>13s}")
    summary = {}
    for m in models:
        rs = runs[m]
        split = statistics.median(x["py"]["split_ms"] / x["cpp"]["split_ms"] for x in rs)
        rel = statistics.median((x["py"]["split_ms"] / x["py"]["fused_ms"])
                                / (x["cpp"]["split_ms"] / x["cpp"]["fused_ms"]) for x in rs)
        fused = statistics.median(x["py"]["fused_ms"] / x["cpp"]["fused_ms"] for x in rs)
        cs = statistics.median(x["cpp"]["split_ms"] for x in rs)
        ps = statistics.median(x["py"]["split_ms"] for x in rs)
        summary[m] = {"split_ratio": split, "split_over_fused_ratio": rel, "fused_ratio": fused,
                      "cpp_split_ms": cs, "py_split_ms": ps}
        print(f"{m:16s} {cs:12.2f} {ps:12.2f} {split:13.3f} {rel:19.3f} {fused:13.3f}")
    print("\n(ratios: medians over rounds of Python / C++ from adjacent runs; "
          "'split/fused' divides each side by its own fused backward first)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": summary, "core": args.core,
                       "rounds": args.rounds}, f, indent=1)


if __name__ == "__main__":
    main()
