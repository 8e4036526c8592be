#!/usr/bin/env python3
"""The peer benchmark's PyTorch side: hyperparallel.models' GPT (the same
nn.Module chunks and batches as the other sides) trained with one of
torch.distributed.pipelining's schedules, 2 ranks as real processes over
Gloo on loopback: float32, AdamW, one intra-op thread per rank, rank r pinned
to core r. Writes per-step losses and times as JSON.

    .venv/bin/python bench/peers/torch_pipelining.py --setting overhead --schedule 1F1B \
        --out run.json

Timed step (the same work as `hp train`'s): after a barrier, the optimizer's
zero_grad, schedule.step (every microbatch's forward and backward),
optimizer.step, and the all-reduce of the step's loss. Compute is the time inside the stage's
per-action calls (forward_one_chunk, backward_one_chunk, which is I when the
schedule splits the backward, backward_weight_one_chunk) and the loss; the
schedules wait for their receives outside those calls, so, like hp's
per-action compute, it excludes communication. A narrower measure,
kernel_seconds, counts only the chunks' forward, the loss and the autograd
engine calls inside the actions.

The loss is the cross-entropy over tokens divided by the number of
microbatches, with scale_grads=False: the accumulated gradient is the mean
over microbatches, the same arithmetic as hp's (which scales the loss by 1/m).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# name: (placement, stages per rank); every one is torch's Schedule<name>.
SCHEDULES = {
    "GPipe": ("single", 1),
    "1F1B": ("single", 1),
    "Interleaved1F1B": ("loop", 2),
    "LoopedBFS": ("loop", 2),
    "InterleavedZeroBubble": ("loop", 2),
    "ZBVZeroBubble": ("v", 2),
    "DualPipeV": ("v", 2),
}


def placement(schedule, p):
    """(number of stages, {rank: [stages]}, {stage: rank})."""
    kind, v = SCHEDULES[schedule]
    if kind == "single":
        owner = {s: s for s in range(p)}
    elif kind == "loop":
        owner = {s: s % p for s in range(p * v)}
    else:  # V: rank r holds stages r and 2p-1-r
        owner = {}
        for r in range(p):
            owner[r] = r
            owner[2 * p - 1 - r] = r
    stages = {r: sorted(s for s, o in owner.items() if o == r) for r in range(p)}
    return len(owner), stages, owner


class TorchSide:
    """This rank's part of PyTorch's schedule over the GPT's chunks, built on
    `group` (default: the world). With `instrument`, the stage's per-action
    calls, the loss and the engine calls are timed (`events`, `kernels`);
    without, nothing is wrapped (paired.py, where both sides share a process).
    `prepare`, if given, makes each chunk as built into the module the stage
    runs (paired_fsdp.py: fully_shard over the data-parallel mesh)."""

    def __init__(self, args, rank, world, config, group=None, instrument=True, prepare=None):
        import torch
        import torch.distributed.pipelining as pp

        from hyperparallel import models, torch_export

        s = common.SETTINGS[args.setting]
        m, rows, T = s["microbatches"], s["microbatch_size"], s["seq_len"]
        num_stages, stages_of, owner = placement(args.schedule, world)
        self.events = []  # (kind, start, end) from the step's start
        self.kernels = []  # durations
        self.t0 = 0.0
        now = time.perf_counter

        def timed(kind, fn):
            def wrapper(*a, **k):
                t = now()
                try:
                    return fn(*a, **k)
                finally:
                    kk = kind if kind != "B" or k.get("full_backward", True) else "I"
                    self.events.append((kk, t - self.t0, now() - self.t0))
            return wrapper

        def loss_fn(out, target):
            if not instrument:
                return models.gpt_loss(out, target) / m
            t = now()
            loss = models.gpt_loss(out, target) / m
            e = now()
            self.events.append(("L", t - self.t0, e - self.t0))
            self.kernels.append(e - t)
            return loss

        def kernel_timed(fn):
            def wrapper(*a, **k):
                t = now()
                try:
                    return fn(*a, **k)
                finally:
                    self.kernels.append(now() - t)
            return wrapper

        if instrument:
            # The engine calls the stage's backward functions look up at each call.
            torch.autograd.grad = kernel_timed(torch.autograd.grad)
            torch.autograd.backward = kernel_timed(torch.autograd.backward)

        def time_module_forward(module):
            started = [0.0]
            module.register_forward_pre_hook(lambda mod, inp: started.__setitem__(0, now()))
            module.register_forward_hook(
                lambda mod, inp, out: self.kernels.append(now() - started[0]))

        my_stages, self.modules = [], []
        build, width = common.chunk_builder(getattr(args, "model", "gpt"), config, args.seed)
        for st in stages_of[rank]:
            chunk = build(st, num_stages)
            if prepare is not None:
                chunk = prepare(chunk)
            example_in = (torch.zeros(rows, T, dtype=torch.int64) if st == 0
                          else torch.zeros(rows, T, width))
            example_out = torch.zeros(rows, T, config.vocab if st == num_stages - 1 else width)
            stage = pp.PipelineStage(chunk, st, num_stages, torch.device("cpu"),
                                     input_args=(example_in,), output_args=(example_out,),
                                     group=group)
            if instrument:
                time_module_forward(chunk)
                stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
                stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
                stage.backward_weight_one_chunk = timed("W", stage.backward_weight_one_chunk)
            my_stages.append(stage)
            self.modules.append(chunk)
        if SCHEDULES[args.schedule][0] == "v":
            # Torch's first-step handshake sends to the neighbour stage at the V's
            # turn, on this same rank: Gloo cannot send to itself (NOTE [Gloo and
            # the V turn] in hyperparallel/torch_export.py).
            torch_export.skip_local_handshake(my_stages)

        cls = getattr(pp, "Schedule" + args.schedule)
        # (torch's V schedules place stages r and 2p-1-r on rank r themselves)
        stages_arg = my_stages[0] if SCHEDULES[args.schedule][0] == "single" else my_stages
        self.schedule = cls(stages_arg, m, loss_fn=loss_fn, scale_grads=False)
        self.optimizer = torch.optim.AdamW([q for mod in self.modules for q in mod.parameters()],
                                           lr=args.lr, weight_decay=args.weight_decay)
        self.has_first = 0 in stages_of[rank]
        self.has_last = num_stages - 1 in stages_of[rank]
        self.stages_of, self.num_stages = stages_of, num_stages
        self.group = group

    def step(self, x, y):
        """One timed step's work: the schedule's step, the optimizer's and the
        all-reduce of the step's loss. Returns the loss."""
        import torch
        import torch.distributed as dist

        self.optimizer.zero_grad(set_to_none=True)
        self.events.clear()
        self.kernels.clear()
        self.t0 = time.perf_counter()
        losses = []
        call_args = (x,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*call_args, target=y, losses=losses)
        else:
            self.schedule.step(*call_args)
        self.optimizer.step()
        loss = torch.tensor([float(sum(v.item() for v in losses))], dtype=torch.float64)
        dist.all_reduce(loss, group=self.group)
        return float(loss.item())


def worker(args):
    rank, world, torch, dist = common.setup_rank(args)
    s = common.SETTINGS[args.setting]
    config, data = common.model_and_data(args.setting, args.seed)
    m = s["microbatches"]
    side = TorchSide(args, rank, world, config)
    stages_of, num_stages = side.stages_of, side.num_stages
    now = time.perf_counter

    result = {"losses": [], "step_seconds": [], "busy_seconds": [], "kernel_seconds": [],
              "makespan_seconds": []}
    with common.Profile(args, rank):
        for step in range(args.steps):
            x, y = data.batch(step, m)
            dist.barrier()
            t0 = now()
            loss = side.step(x, y)
            t1 = now()
            events, kernels = side.events, side.kernels
            busy = sum(e - b for _, b, e in events)
            last_end = max((e for _, _, e in events), default=0.0)
            everyone = common.gather_last_step(dist, torch, world, busy, last_end, [sum(kernels)])
            result["losses"].append(loss)
            result["step_seconds"].append(t1 - t0)
            result["busy_seconds"].append([r[0] for r in everyone])
            result["makespan_seconds"].append(max(r[1] for r in everyone))
            result["kernel_seconds"].append([r[2] for r in everyone])
            if rank == 0 and args.verbose:
                print(f"step {step}: loss {loss:.6f} {(t1 - t0) * 1e3:.1f} ms", file=sys.stderr)
    if rank == 0:
        result.update({"side": "torch", "schedule": args.schedule, "nproc": world,
                       "stages": num_stages,
                       "placement": {str(r): v for r, v in stages_of.items()},
                       "setting": args.setting, "torch": torch.__version__,
                       "threads": args.threads, "pinned": not args.no_pin})
        common.write_result(args.out, result)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_arguments(ap)
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.schedule not in SCHEDULES:
        ap.error(f"--schedule: one of {', '.join(SCHEDULES)}")
    if args.worker:
        worker(args)
        common.end_rank()
    return common.launch(os.path.abspath(__file__), args.nproc, argv, args.timeout, args.threads)


if __name__ == "__main__":
    sys.exit(main())
