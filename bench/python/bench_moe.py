"""Expert parallelism's cost, side by side in one run: a transformers
Mixtral MoE block's forward + backward with its experts spread over 2 ranks
(hyperparallel.moe.expert_parallel; real processes over Gloo, each pinned
to one core with one intra-op thread) against the same block with every
expert local on each rank (the same tokens, the same FLOPs per rank when the
routing is balanced; the dispatcher's permutation with no exchange), the
model's own block unconverted (its loop over experts), and the all-to-alls
alone (dispatch and combine of the same rows, forward and backward, experts
that compute nothing). The variants alternate within each round; medians
over rounds.

    .venv/bin/python bench/python/bench_moe.py --sizes 512x256x512,1024x512x1024

A size is TOKENSxD_MODELxEXPERT_WIDTH (tokens per rank); 8 experts, top 2.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_sizes(text):
    sizes = []
    for part in text.split(","):
        try:
            t, d, h = (int(v) for v in part.split("x"))
        except ValueError:
            sys.exit(f"bench_moe: --sizes takes TOKENSxD_MODELxEXPERT_WIDTH,...; got {part!r}")
        if min(t, d, h) < 1:
            sys.exit(f"bench_moe: every number of a size must be positive; got {part!r}")
        sizes.append((t, d, h))
    return sizes


def block(d, h, experts, top_k, seed):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=d, intermediate_size=h, num_local_experts=experts,
                           num_experts_per_tok=top_k, experts_implementation="eager")
    torch.manual_seed(seed)
    b = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.02)
    return b


def rank_main(rank, world, store, args, sizes, out):
    import hyperparallel as hp

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD
    rows = []
    for t, d, h in sizes:
        own = block(d, h, args.experts, args.top_k, 1)
        local = hp.moe.expert_parallel(block(d, h, args.experts, args.top_k, 1), None)
        spread = hp.moe.expert_parallel(block(d, h, args.experts, args.top_k, 1), group)
        x = torch.randn(1, t, d, generator=torch.Generator().manual_seed(10 + rank))
        disp = hp.moe.TokenDispatcher(group, args.experts)
        idx = torch.randint(0, args.experts, (t, args.top_k),
                            generator=torch.Generator().manual_seed(20 + rank))
        w = torch.rand(t, args.top_k)

        def run_block(b):
            xi = x.clone().requires_grad_(True)
            b(xi).sum().backward()

        def run_exchange():
            xi = x[0].clone().requires_grad_(True)
            dd = disp.dispatch(xi, idx)
            disp.combine(dd.tokens, dd, w).sum().backward()

        variants = {"own": lambda: run_block(own), "local": lambda: run_block(local),
                    "ep": lambda: run_block(spread), "all-to-all": run_exchange}
        times = {k: [] for k in variants}
        for _ in range(2):  # warm-up
            for fn in variants.values():
                fn()
        for r in range(args.rounds):
            order = list(variants)[r % 4:] + list(variants)[:r % 4]
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    variants[k]()
                dist.barrier()
                times[k].append((time.perf_counter() - t0) / args.reps)
        rows.append({"size": (t, d, h), **{k: statistics.median(v) for k, v in times.items()},
                     "ratio_ep": statistics.median(
                         e / l for e, l in zip(times["ep"], times["local"]))})
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="512x256x512,1024x512x1024")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(rank_main, args=(2, os.path.join(tmp, "store"), args, sizes, out), nprocs=2)
        rows = torch.load(out)
    print(f"MoE block forward + backward, {args.experts} experts top {args.top_k}, float32, "
          "2 ranks (1 thread, pinned); ms per call, median of rounds")
    print("| tokens/rank x d x width | the model's own block | all experts local | ep 2 | "
          "ep / local | all-to-alls alone |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        t, d, h = r["size"]
        print(f"| {t} x {d} x {h} | {1e3 * r['own']:.2f} | {1e3 * r['local']:.2f} | {1e3 * r['ep']:.2f} | "
              f"{r['ratio_ep']:.3f} | {1e3 * r['all-to-all']:.2f} |")


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
