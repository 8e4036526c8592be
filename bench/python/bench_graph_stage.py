"""What a compiled stage's backward costs split into I (dx) and W (dw),
against the same stage's fused backward, side by side in one process: a
middle chunk of the GPT of hyperparallel.models (CPU, one thread; or a GPU
with ``--device cuda``, timed after a synchronize), each
variant's backward timed in turn, round after round, so they share the
machine's noise:

* ``graph-inductor``: ``GraphStage(chunk, backend="inductor")``: the fused
  backward graph against its dx graph then its dw graph (NOTE [Graph stages]),
  each compiled by inductor;
* ``graph-inductor-sums``: the same, its bias gradients' sums left to
  inductor's own reduction (NOTE [Column sums as products]), what the graphs
  were compiled with before (on a GPU the two are the same graphs);
* ``graph-replay``: the same graphs replayed as they are (no backend);
* ``torch.compile``: ``torch.compile(chunk)``: its backward is one autograd
  node, so a split schedule runs it whole in I and again in W (NOTE [Compiled
  stages under a split schedule]): what a compiled stage cost before;
* ``eager``: the chunk as it is, split by LibTorch's engine (hp/autograd).

Each variant's fused and split backwards alternate, one of each in turn, so
that a slow spell of the machine falls on both.

Each split backward runs through hyperparallel.split.forward_and_gradfn
(compute_input_grad, then compute_weight_grad into .grad only), as the
pipeline's executor splits a stage; each fused one as one backward. CPU
tensors take their memory from the step cache, as they do in the Pipeline's
steps on the CPU (``Pipeline(keep_freed_memory)``, on by default there).

    .venv/bin/python bench/python/bench_graph_stage.py [--rounds 7] [--reps 10]
    .venv/bin/python bench/python/bench_graph_stage.py --sizes 128x64,256x128,512x128 \
        --rounds 3 --reps 6
    python3 bench/python/bench_graph_stage.py --device cuda --dtype bfloat16 \
        --d-model 1024 --seq-len 1024

Prints, per size and variant, the median fused and split backward in ms,
their ratio (split / fused) and the median of the ratios of each split to
the fused backward timed just before it; then, per size, graph-inductor's
split / fused against the goal of at most 1.05 (docs/benchmarks.md, "A
compiled stage's backward in two halves").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10, help="backwards per variant per round")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--sizes", default=None,
                    help="d_model x seq_len pairs, comma-separated (e.g. 128x64,256x128): "
                         "one table per size, in one run; overrides --d-model and --seq-len")
    ap.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    args = ap.parse_args()
    sizes = [(args.d_model, args.seq_len)]
    if args.sizes is not None:
        try:
            sizes = [tuple(int(v) for v in item.lower().split("x"))
                     for item in args.sizes.split(",")]
        except ValueError:
            sizes = []
        if not sizes or any(len(sz) != 2 or min(sz) < 1 for sz in sizes):
            ap.error(f"--sizes {args.sizes!r}: give d_model x seq_len pairs such as 128x64,256x128")
    if any(d % 4 or d < 1 or n < 1 for d, n in sizes):
        ap.error("each d_model must be a positive multiple of the 4 heads, each seq_len positive")

    import torch
    import torch._functorch.config as functorch_config

    from hyperparallel import _C, models
    from hyperparallel.compile import GraphPass, GraphStage
    from hyperparallel.compile import stage as stage_module
    from hyperparallel.split import forward_and_gradfn

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_graph_stage: --device cuda, but torch sees no GPU")
    torch.set_num_threads(1)
    _C.pipeline.keep_freed_memory_mapped()
    cache = _C.pipeline.StepCacheScope()  # noqa: F841 - held until the end

    def now() -> float:  # a GPU's work is timed once it is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    class SumsKept(GraphPass):  # captures without the rewrite
        def run(self, gm, **context):
            return gm

    def measure(d_model: int, seq_len: int):
        """One size: every variant timed, its table printed; returns graph-inductor's
        split / fused: of the medians, and the median of the pair ratios."""
        config = models.GPTConfig(layers=6, d_model=d_model, heads=4, seq_len=seq_len)

        def chunk():  # the middle third: two blocks, activations in and out
            return models.GPT(config, seed=0, chunk=1, num_chunks=3).to(device=device, dtype=dtype)

        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.rows, seq_len, d_model, generator=g).to(device, dtype)
        sens = torch.randn(args.rows, seq_len, d_model, generator=g).to(device, dtype)
        variants = {
            "graph-inductor": GraphStage(chunk(), backend="inductor"),
            "graph-inductor-sums": GraphStage(chunk(), backend="inductor"),
            "graph-replay": GraphStage(chunk()),
            "torch.compile": torch.compile(chunk()),
            "eager": chunk(),
        }

        def fused(mod) -> float:
            xi = x.detach().requires_grad_()
            out = mod(xi)
            t = now()
            out.backward(sens)
            return now() - t

        def split(mod) -> float:
            weights = [p for p in mod.parameters()]
            out, gf = forward_and_gradfn(mod, x.detach().requires_grad_(), weights=weights)
            t = now()
            gf.compute_input_grad(sens)
            gf.compute_weight_grad(return_grads=False)  # the Pipeline's W: dw only into .grad
            return now() - t

        times = {(v, k): [] for v in variants for k in ("fused", "split")}
        with functorch_config.patch(donated_buffer=False):  # as the Pipeline runs torch.compile
            print(f"d_model {d_model}, {args.rows} x {seq_len} tokens: compiling (inductor: the "
                  "forward and the three backward graphs) ...", file=sys.stderr, flush=True)
            rewrite = stage_module.ColumnSumsAsProducts
            for v, mod in variants.items():  # compile and warm up outside the timing
                kept = v == "graph-inductor-sums"
                stage_module.ColumnSumsAsProducts = SumsKept if kept else rewrite
                try:
                    for _ in range(2):
                        fused(mod)
                        split(mod)
                finally:
                    stage_module.ColumnSumsAsProducts = rewrite
                mod.zero_grad()
            for r in range(args.rounds):
                for v, mod in variants.items():
                    for _ in range(args.reps):  # fused and split in turn: they share the noise
                        times[(v, "fused")].append(fused(mod))
                        times[(v, "split")].append(split(mod))
                    mod.zero_grad()
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)

        stage = variants["graph-inductor"]
        print(f"GPT middle chunk: 2 blocks, d_model {d_model}, {args.rows} x {seq_len} "
              f"tokens, {args.dtype}, {'1 thread' if device.type == 'cpu' else device}; "
              f"{args.rounds} rounds x {args.reps} backwards")
        print(f"graph-inductor runs: {stage.counts}")
        for v in ("graph-inductor", "graph-inductor-sums"):
            (g,) = variants[v].graphs()
            sums = {name: sum(n.target is torch.ops.aten.sum.dim_IntList
                              for n in getattr(g, name).graph.nodes)
                    for name in ("dx", "dw", "backward")}
            print(f"{v}: sums in the graphs {sums}")
        print("| variant | fused backward (ms) | split: I + W (ms) | split / fused "
              "| median of pair ratios |")
        print("|---|---|---|---|---|")
        ratios = {}
        for v in variants:
            f = statistics.median(times[(v, "fused")]) * 1e3
            s = statistics.median(times[(v, "split")]) * 1e3
            pairs = statistics.median(b / a for a, b in zip(times[(v, "fused")],
                                                             times[(v, "split")]))
            print(f"| {v} | {f:.2f} | {s:.2f} | {s / f:.3f} | {pairs:.3f} |")
            ratios[v] = (s / f, pairs)
        print()
        return ratios["graph-inductor"]

    results = {size: measure(*size) for size in sizes}
    print("graph-inductor, split / fused (median of pair ratios); goal: both at most 1.05")
    for (d_model, seq_len), (ratio, pairs) in results.items():
        met = "met" if max(ratio, pairs) <= 1.05 else "not met"
        print(f"  d_model {d_model}, {args.rows} x {seq_len} tokens: {ratio:.3f} ({pairs:.3f}): "
              f"{met}")


if __name__ == "__main__":
    main()
