#!/usr/bin/env python3
"""The peer benchmark's hyperparallel Python side: the same nn.Module chunks
and batches as the PyTorch side (hyperparallel.models), run by
hyperparallel.pipeline.Pipeline (our C++ executor over the Gloo group
torch.distributed made), 2 ranks as real processes on loopback: float32,
AdamW, one intra-op thread per rank, rank r pinned to core r. Writes per-step
losses and times as JSON, in torch_pipelining.py's form.

    .venv/bin/python bench/peers/hp_python.py --setting overhead --schedule 1f1b --out run.json

Timed step (the same work as the other sides'): after a barrier, the
optimizer's zero_grad, Pipeline.step (every microbatch's forward and backward,
and the all-reduce of the step's loss) and optimizer.step. Compute, comm wait
and overhead per rank are the executor's own (Pipeline.last_stats, NOTE
[Compute events exclude waits]); the makespan is the last compute action's
end over the ranks.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

COMPUTE = ("F", "I", "W", "B")


class HpSide:
    """This rank's part of the schedule on hyperparallel.pipeline.Pipeline over
    the GPT's chunks, on `group` (default: the world); `prepare`, if given,
    makes each chunk as built into the module the Pipeline runs."""

    def __init__(self, args, rank, world, config, group=None, prepare=None):
        import torch

        import hyperparallel as hp
        from hyperparallel import models

        s = common.SETTINGS[args.setting]
        m = s["microbatches"]
        self.sched = hp.pipeline.schedule(args.schedule, ranks=world, microbatches=m,
                                          chunks=args.chunks)
        build, _ = common.chunk_builder(getattr(args, "model", "gpt"), config, args.seed)
        chunks = {c: build(c, self.sched.num_chunks) for c in self.sched.chunks_of_rank(rank)}
        if prepare is not None:
            chunks = {c: prepare(mod) for c, mod in chunks.items()}
        self.pipe = hp.pipeline.Pipeline(
            chunks, self.sched, loss_fn=models.gpt_loss,
            activation_shape=config.activation_shape(s["microbatch_size"]), group=group,
            timeout=args.timeout, receive_lookahead=args.receive_lookahead,
            keep_freed_memory=not args.malloc_default, p2p=args.p2p)
        parameters = [q for c in chunks.values() for q in c.parameters()]
        self.optimizer = torch.optim.AdamW(parameters, lr=args.lr,
                                           weight_decay=args.weight_decay)
        self.last_outside = 0.0

    def step(self, x, y):
        """One timed step's work: the optimizer's zero_grad, Pipeline.step
        (which all-reduces the loss) and the optimizer's step; last_outside
        keeps the seconds of the two optimizer calls. Returns the loss."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = self.pipe.step(x, y)
        t2 = time.perf_counter()
        self.optimizer.step()
        # The step's work outside the schedule's actions, which any runtime has too.
        self.last_outside = (t1 - t0) + (time.perf_counter() - t2)
        return float(loss)


def worker(args):
    rank, world, torch, dist = common.setup_rank(args)
    s = common.SETTINGS[args.setting]
    config, data = common.model_and_data(args.setting, args.seed)
    m = s["microbatches"]
    side = HpSide(args, rank, world, config)
    sched, pipe = side.sched, side.pipe

    result = {"losses": [], "step_seconds": [], "busy_seconds": [], "comm_wait_seconds": [],
              "overhead_seconds": [], "makespan_seconds": []}
    now = time.perf_counter
    with common.Profile(args, rank):
        for step in range(args.steps):
            x, y = data.batch(step, m)
            dist.barrier()
            t0 = now()
            loss = side.step(x, y)
            t1 = now()
            st = pipe.last_stats
            # An FB action's text is "2F0+1B3"; compute events are every non-transfer one.
            last_end = max((e for a, _, e in st["events"] if "SEND" not in a and "RECV" not in a),
                           default=0.0)
            everyone = common.gather_last_step(dist, torch, world, st["compute"], last_end,
                                               [st["comm_wait"], st["overhead"]])
            result["losses"].append(float(loss))
            result["step_seconds"].append(t1 - t0)
            result["busy_seconds"].append([r[0] for r in everyone])
            result["makespan_seconds"].append(max(r[1] for r in everyone))
            result["comm_wait_seconds"].append([r[2] for r in everyone])
            result["overhead_seconds"].append([r[3] for r in everyone])
            if rank == 0 and args.verbose:
                print(f"step {step}: loss {loss:.6f} {(t1 - t0) * 1e3:.1f} ms", file=sys.stderr)
    if rank == 0:
        result.update({"side": "hp-py", "schedule": args.schedule, "chunks": args.chunks,
                       "nproc": world, "stages": sched.num_stages,
                       "placement": {str(r): sched.stages_of_rank(r) for r in range(world)},
                       "setting": args.setting, "torch": torch.__version__,
                       "backend": pipe._runtime.backend, "threads": args.threads,
                       "pinned": not args.no_pin})
        common.write_result(args.out, result)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_arguments(ap)
    ap.add_argument("--chunks", type=int, default=2, help="virtual stages per rank (interleaved)")
    ap.add_argument("--receive-lookahead", type=int, default=0,
                    help="Pipeline(receive_lookahead=...): receives posted N batches ahead "
                         "(default 0)")
    ap.add_argument("--p2p", default="auto", choices=["auto", "group", "shm"],
                    help="Pipeline(p2p=...): its default (auto: shared-memory rings between "
                         "the ranks where every rank could reserve them), the group's "
                         "point-to-point, or the rings insisted on")
    ap.add_argument("--malloc-default", action="store_true",
                    help="Pipeline(keep_freed_memory=False): leave glibc's malloc as it is")
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        common.end_rank()
    return common.launch(os.path.abspath(__file__), args.nproc, argv, args.timeout, args.threads)


if __name__ == "__main__":
    sys.exit(main())
