#!/usr/bin/env python3
"""hp's reference GPT trained with PyTorch's own torch.distributed.pipelining.

Reads the work `hp peers export` wrote (the whole model's initial parameters
and every (step, microbatch) batch, NOTE [Peers export format] in
tools/hp/cmd_torch_peers.cpp), rebuilds exactly hp's GPT (hp/models/models.cpp)
cut into the same chunks as hp's build_chunk(spec, index, num_chunks), and
trains it with one of PyTorch's pipeline schedules on real processes over Gloo
on loopback: float32, AdamW, one intra-op thread per rank, rank r pinned to
core r. Writes per-step losses and wall times as JSON.

    python3 torch_pipelining.py --export DIR --schedule 1F1B --out run.json

Timed step (the same work as `hp train`'s timed step): after a barrier,
schedule.step (all microbatches' forward and backward), optimizer.step, and
the all-reduce of the step's loss. Compute is the time inside the stage's
per-action calls (forward_one_chunk, backward_one_chunk, which is I when the
schedule asks for a split backward, backward_weight_one_chunk) and the loss
function: the schedules wait for their receives outside those calls, so, like
hp's per-action compute, it excludes communication. A narrower measure,
kernel_seconds, counts only the chunk modules' forward, the loss and the
autograd engine calls inside them.

Needs Python 3 and PyTorch 2.6 (Debian 13's python3-torch): CPU and Gloo only.
"""
import argparse
import faulthandler
import json
import math
import os
import socket
import subprocess
import sys
import time

SCHEDULES = {
    # name: (placement, stages per rank)
    "GPipe": ("single", 1),
    "1F1B": ("single", 1),
    "Interleaved1F1B": ("loop", 2),
    "LoopedBFS": ("loop", 2),
    "InterleavedZeroBubble": ("loop", 2),
    "ZBVZeroBubble": ("v", 2),
}


# ---------------------------------------------------------------------------
# The exported work.
# ---------------------------------------------------------------------------
def load_export(folder):
    import torch

    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != "hp-peers-1" or manifest.get("byte_order") != "little":
        raise SystemExit(f"{folder}: not an hp-peers-1 little-endian export")
    if sys.byteorder != "little":
        raise SystemExit("this reader assumes a little-endian machine")
    with open(os.path.join(folder, manifest["data"]), "rb") as f:
        blob = bytearray(f.read())
    dtypes = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}

    def tensor(e):
        t = torch.frombuffer(blob, dtype=dtypes[e["dtype"]],
                             count=math.prod(e["shape"]) if e["shape"] else 1,
                             offset=e["offset"])
        return t.reshape(e["shape"]).clone()

    params = {e["name"]: tensor(e) for e in manifest["parameters"]}
    batches = {}
    for b in manifest["batches"]:
        batches[(b["step"], b["microbatch"])] = (tensor(b["input"]), tensor(b["target"]))
    return manifest, params, batches


# ---------------------------------------------------------------------------
# hp's GPT (hp/models/models.cpp), parameter names model-wide.
# ---------------------------------------------------------------------------
def build_classes():
    import torch
    from torch import nn

    class Block(nn.Module):
        """Pre-norm block: causal self-attention and an exact-erf GELU MLP."""

        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)  # eps 1e-5, affine: as torch::nn::LayerNorm
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, D = x.shape
            hd = D // self.heads
            q, k, v = self.qkv(self.ln1(x)).split(D, -1)

            def split_heads(t):
                return t.view(B, T, self.heads, hd).transpose(1, 2)

            q, k, v = split_heads(q), split_heads(k), split_heads(v)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = q.matmul(k.transpose(-2, -1)).mul(1.0 / math.sqrt(hd))
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            y = att.matmul(v).transpose(1, 2).reshape(B, T, D)
            h = x + self.proj(y)
            return h + self.fc2(torch.nn.functional.gelu(self.fc(self.ln2(h))))

    class Embed(nn.Module):
        def __init__(self, vocab, seq_len, d):
            super().__init__()
            self.wte = nn.Parameter(torch.empty(vocab, d))
            self.wpe = nn.Parameter(torch.empty(seq_len, d))

    class Final(nn.Module):
        def __init__(self, vocab, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.head = nn.Parameter(torch.empty(vocab, d))

    class GptChunk(nn.Module):
        """Chunk `index` of `n`: blocks cut as hp's layer_range (earlier chunks
        take the remainder); chunk 0 has the embeddings, the last the final
        LayerNorm and the untied head."""

        def __init__(self, spec, index, n):
            super().__init__()
            L = spec["layers"]
            base, extra = divmod(L, n)
            begin = index * base + min(index, extra)
            end = begin + base + (1 if index < extra else 0)
            self.first, self.last = index == 0, index == n - 1
            d = spec["d_model"]
            if self.first:
                self.embed = Embed(spec["vocab"], spec["seq_len"], d)
            self.block_names = []
            for b in range(begin, end):
                self.add_module(f"block{b}", Block(d, spec["heads"]))
                self.block_names.append(f"block{b}")
            if self.last:
                self.final = Final(spec["vocab"], d)

        def forward(self, x):
            h = x
            if self.first:
                h = torch.embedding(self.embed.wte, x) + self.embed.wpe.narrow(0, 0, x.size(1))
            for name in self.block_names:
                h = getattr(self, name)(h)
            if self.last:
                h = torch.matmul(self.final.ln(h), self.final.head.t())
            return h

    return GptChunk


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
    stages = {r: sorted((s for s, o in owner.items() if o == r),
                        key=lambda s: (kind == "v" and s >= p, s)) for r in range(p)}
    return len(owner), stages, owner


def fix_batch_p2p_for_gloo():
    """PyTorch 2.6's schedules._batch_p2p keeps only the last Work that
    dist.batch_isend_irecv returns. NCCL coalesces a batch into one Work; Gloo
    returns one per operation, and the dropped send Works are destroyed before
    their transfer is done: every schedule that fuses a send with a receive
    hangs on Gloo (pytorch/pytorch#132644). Later releases wait on every Work
    (pytorch/pytorch#152938); this applies the same change to 2.6."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sch

    class AllWorks:
        def __init__(self, works):
            self.works = works

        def wait(self):
            for w in self.works:
                w.wait()

    def batch_p2p(p2p_ops, desc=None):
        if len(p2p_ops) == 0:
            return None
        return AllWorks(dist.batch_isend_irecv(p2p_ops))

    sch._batch_p2p = batch_p2p


# ---------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------
def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A rank that hangs shows where, shortly before the launcher gives up.
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=True)
    if not args.no_pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pp

    torch.set_num_threads(args.threads)
    fix_batch_p2p_for_gloo()
    manifest, params, batches = load_export(args.export)
    spec = manifest["model"]
    if spec["kind"] != "gpt" or spec["tied_head"] or spec["dtype"] != "float32":
        raise SystemExit("this peer runs the untied float32 gpt only (hp peers export --untied)")
    m, rows, T = manifest["microbatches"], manifest["microbatch_size"], spec["seq_len"]
    steps = min(args.steps or manifest["steps"], manifest["steps"])

    dist.init_process_group("gloo", rank=rank, world_size=world)
    num_stages, stages_of, owner = placement(args.schedule, world)
    GptChunk = build_classes()

    # --- timing of compute: the stage's per-action calls and the loss ---
    events = []  # (kind, start, end) relative to the step's start
    clock = {"t0": 0.0}
    now = time.perf_counter

    def timed(kind, fn):
        def wrapper(*a, **k):
            s = now()
            try:
                return fn(*a, **k)
            finally:
                k_ = kind if kind != "B" or k.get("full_backward", True) else "I"
                events.append((k_, s - clock["t0"], now() - clock["t0"]))
        return wrapper

    def loss_fn(out, target):
        s = now()
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)),
                                                 target.reshape(-1)) / m
        e = now()
        events.append(("L", s - clock["t0"], e - clock["t0"]))
        kernels.append(e - s)
        return loss

    # The same compute counted more narrowly: only the chunk modules' forward,
    # the loss and the autograd engine calls (torch.autograd.grad/backward,
    # which the stage's backward functions look up at each call). The stage's
    # per-action Python work around them (e.g. stage_backward_input's walk of
    # the autograd graph to group the weights) is left out.
    kernels = []  # durations

    def kernel_timed(fn):
        def wrapper(*a, **k):
            s = now()
            try:
                return fn(*a, **k)
            finally:
                kernels.append(now() - s)
        return wrapper

    torch.autograd.grad = kernel_timed(torch.autograd.grad)
    torch.autograd.backward = kernel_timed(torch.autograd.backward)

    def time_module_forward(module):
        started = [0.0]

        def pre(mod, inp):
            started[0] = now()

        def post(mod, inp, out):
            kernels.append(now() - started[0])

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    # --- this rank's chunks, loaded with the exported values ---
    my_stages, modules = [], []
    for s in stages_of[rank]:
        chunk = GptChunk(spec, s, num_stages)
        state = chunk.state_dict()
        missing = [k for k in state if k not in params]
        if missing:
            raise SystemExit(f"export lacks {missing}")
        chunk.load_state_dict({k: params[k] for k in state}, strict=True)
        example_in = (torch.zeros(rows, T, dtype=torch.int64) if s == 0
                      else torch.zeros(rows, T, spec["d_model"]))
        example_out = torch.zeros(rows, T, spec["vocab"] if s == num_stages - 1
                                  else spec["d_model"])
        time_module_forward(chunk)
        stage = pp.PipelineStage(chunk, s, num_stages, torch.device("cpu"),
                                 input_args=(example_in,), output_args=(example_out,))
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed("W", stage.backward_weight_one_chunk)
        my_stages.append(stage)
        modules.append(chunk)

    cls = getattr(pp, "Schedule" + args.schedule)
    runtime = args.runtime
    if runtime == "auto":
        runtime = "ir" if args.schedule == "ZBVZeroBubble" else "class"
    if SCHEDULES[args.schedule][0] == "single":
        if runtime == "ir":
            raise SystemExit("--runtime ir needs a schedule with several stages per rank")
        schedule = cls(my_stages[0], m, loss_fn=loss_fn)
    elif args.schedule == "ZBVZeroBubble":
        schedule = cls(my_stages, m, loss_fn=loss_fn, stage_index_to_group_rank=owner)
    else:
        schedule = cls(my_stages, m, loss_fn=loss_fn)
    if runtime == "ir":
        # NOTE: the class's own step (PipelineScheduleMulti._step_microbatches)
        # sends an activation to the next stage even when that stage is on the
        # same rank (ZB-V's turn); NCCL can send to itself, Gloo cannot
        # ("writev: Bad file descriptor"). PyTorch's own action-list runtime,
        # _PipelineScheduleRuntime, lowers the same per-rank order with
        # SEND/RECV actions and hands local activations over in memory.
        import torch.distributed.pipelining.schedules as sch

        order = schedule.pipeline_order
        schedule = sch._PipelineScheduleRuntime(my_stages, m, loss_fn=loss_fn,
                                                stage_index_to_group_rank=owner)
        schedule._load_actions(order)

    parameters = [q for mod in modules for q in mod.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=args.weight_decay)
    has_first = 0 in stages_of[rank]
    has_last = num_stages - 1 in stages_of[rank]

    result = {"losses": [], "step_seconds": [], "pipeline_seconds": [], "busy_seconds": [],
              "kernel_seconds": [],
              "makespan_seconds": [], "span_bubble": []}
    for step in range(steps):
        x = torch.cat([batches[(step, k)][0] for k in range(m)])
        y = torch.cat([batches[(step, k)][1] for k in range(m)])
        optimizer.zero_grad(set_to_none=True)
        events.clear()
        kernels.clear()
        dist.barrier()
        clock["t0"] = t0 = now()
        losses = []
        call_args = (x,) if has_first else ()
        if has_last:
            schedule.step(*call_args, target=y, losses=losses)
        else:
            schedule.step(*call_args)
        t_pipe = now()
        optimizer.step()
        loss = torch.tensor([float(sum(l.item() for l in losses))], dtype=torch.float64)
        dist.all_reduce(loss)
        t1 = now()
        # Compute of this step: busy time, first F start, last compute end.
        busy = sum(e - s for _, s, e in events)
        first_f = min((s for k, s, _ in events if k == "F"), default=0.0)
        last_end = max((e for _, _, e in events), default=0.0)
        mine = torch.tensor([busy, last_end - first_f, last_end, sum(kernels)],
                            dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        busy_r = [float(t[0]) for t in everyone]
        span = max(float(t[1]) for t in everyone)
        result["losses"].append(float(loss.item()))
        result["step_seconds"].append(t1 - t0)
        result["pipeline_seconds"].append(t_pipe - t0)
        result["busy_seconds"].append(busy_r)
        result["kernel_seconds"].append([float(t[3]) for t in everyone])
        result["makespan_seconds"].append(max(float(t[2]) for t in everyone))
        result["span_bubble"].append((span - max(busy_r)) / span if span > 0 else 0.0)
        if rank == 0 and args.verbose:
            print(f"step {step}: loss {result['losses'][-1]:.6f} "
                  f"{(t1 - t0) * 1e3:.1f} ms", file=sys.stderr)
    if rank == 0:
        result.update({"schedule": args.schedule, "runtime": runtime, "nproc": world,
                       "stages": num_stages,
                       "placement": {str(r): s for r, s in stages_of.items()},
                       "microbatches": m, "microbatch_size": rows, "model": spec,
                       "lr": args.lr, "weight_decay": args.weight_decay,
                       "torch": torch.__version__, "threads": args.threads,
                       "pinned": not args.no_pin})
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The launcher: one process per rank, torchrun's variables.
# ---------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv):
    env = dict(os.environ, WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(args.port or free_port()), GLOO_SOCKET_IFNAME="lo", USE_LIBUV="0",
               OMP_NUM_THREADS=str(args.threads))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--worker"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(args.nproc)]
    deadline = time.monotonic() + args.timeout
    codes = [None] * args.nproc
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                print(f"torch_pipelining: timed out after {args.timeout} s", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        print(f"torch_pipelining: ranks ended with {codes}", file=sys.stderr)
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="folder written by hp peers export")
    ap.add_argument("--schedule", required=True, choices=sorted(SCHEDULES),
                    help="torch.distributed.pipelining.Schedule<NAME>")
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="0: every exported step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="AdamW weight decay (hp's default 0; PyTorch's would be 0.01)")
    ap.add_argument("--runtime", choices=["auto", "class", "ir"], default="auto",
                    help="class: the schedule class's own step; ir: its per-rank order run by "
                         "PyTorch's _PipelineScheduleRuntime (auto: ir for ZBVZeroBubble, which "
                         "needs it on Gloo, class otherwise)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--no-pin", action="store_true", help="do not pin rank r to core r")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
