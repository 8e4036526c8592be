#!/usr/bin/env python3
"""Expert parallelism: PyTorch's pipelining against our Python runtime with
the same expert-parallel stages, pp 2 x ep 2, step by step in the same
processes (paired.py's method on 4 ranks).

    .venv/bin/python bench/peers/paired_ep.py --rounds 3 --steps 10

The model: a tiny transformers Mixtral (float32; MODEL below: hidden 128, 4
experts, top 2, 4 layers, vocabulary 256, eager attention), built once per
rank from a seed, then for each side a deep copy of it cut by split_model
into the row's chunks and its experts spread with
hyperparallel.moe.expert_parallel over that side's expert-parallel group:
the same chunks, values and expert placement on both sides. The groups are
hp.pipeline.mesh(pp=2, dp=2, ep=2), made once per side (each side its own
Gloo groups): ranks 0, 1 and 2, 3 are the two pipelines (copies), {0, 2}
and {1, 3} the expert-parallel groups, which are also the data-parallel
ones. Copy e of step k trains on rows [e * m * MB, (e + 1) * m * MB) of the
step's global batch (random token ids from a seeded generator, m
microbatches of MB sequences each per copy); the same batches on both sides.

Rows (PyTorch / ours): ScheduleDualPipeV / dualpipev, ScheduleZBVZeroBubble /
zbv, and ZB-H1, which torch ships no class of: our zb-h1 loaded into torch's
own _PipelineScheduleRuntime by hyperparallel.torch_export.make_torch_runtime
(torch's runtime and stages running our action list). With --fb-overlap the
dualpipev row has a third side: ours with Pipeline(fb_overlap=True), each FB
pair's forward and backward taking turns at their all-to-alls and transfers
(torch's runtime runs its OVERLAP_F_B as F, then B).

    .venv/bin/python bench/peers/paired_ep.py --rounds 3 --steps 10 --fb-overlap \
        --link 1000,1

--link LATENCY_US,GBPS runs every rank under HP_LINK=LATENCY_US,GBPS, set
before any Pipeline or expert dispatcher is made (NOTE [The link model] in
hp/distributed/link_model.cpp; docs/overlap.md): every message a rank posts
through hyperparallel's point-to-point leaves through one modelled link of
that latency and bandwidth. The expert all-to-alls are our dispatcher's on
both sides, so both pay the link; our side's pipeline transfers pay it too
(over its Gloo group: p2p "auto" leaves out the shared-memory rings, which
would bypass the link, and --hp-p2p shm is refused); PyTorch's own
pipeline sends pay a link of the same latency and bandwidth in Python
(torch_link.py, replacing its schedules' _batch_p2p), beside the one its
all-to-alls pay (two interfaces where ours share one, which favours PyTorch
a little). The collectives of either side (the gradient all-reduce over the
EP group, the losses) are not delayed. Without --link, loopback (an
HP_LINK of the environment is cleared).

Each side has its own AdamW and makes the same step: a barrier, zero_grad,
the schedule's forward and backward of every microbatch, the data-parallel
reduction over the EP group (NOTE [Expert gradients] in
hp/pipeline/pipeline.cpp: every non-expert gradient averaged over the
group, every expert gradient, which already holds the group's rows, divided
by its size), the optimizer's step, and the step's loss (the mean over the
microbatches and the two copies) on every rank. Ours does the reduction
inside Pipeline.step (dp_group=ep); PyTorch's side, which has no notion of
experts, does it after schedule.step with one all-reduce of its flattened
non-expert gradients over its EP group and a division of the expert ones
(TorchEpSide.step). The two sides' losses must agree (relative 1e-4) at
every step of every run, else the script exits non-zero.

Pairing (paired.take_turns): step k of one side, step k of the other (who
goes first alternates), each after a barrier over the 4 ranks; a row's
ratio is the median of PyTorch's step over ours over its pairs (above 1: we
are faster), with the middle half of the pairs beside it. The first step of
each side is warm-up. Four processes share the host's cores (rank r pinned
to core r mod the cores, one intra-op thread each).

NOTE [Torch's split backward with expert-parallel stages]
torch's stage_backward_input (the I of ZBVZeroBubble, DualPipeV and of any
runtime action list with I and W) ends with `t.detach_()` on every stage
output, to free the graph, and a view cannot be detached in place ("Can't
detach views in-place"). A stage whose output comes straight from
torch.distributed.nn.functional.all_to_all_single has such an output: that
function fills and returns the `output` tensor it was given, and autograd
makes a custom Function's output that is one of its inputs a view of it
(`_is_view()` is True on its result). The converted Mixtral chunks do not
hit it: hyperparallel.moe's dispatch and combine are autograd nodes of the
C++ dispatcher, not that Function, and a decoder layer adds the residual
after the combine, so chunks 0..S-2 end with an add (a fresh tensor:
AddBackward0, `_is_view()` False) and the last one's I starts from the
loss; every row here runs torch's split unchanged. A stage of another model that ends
with such a view would need the view made a tensor of its own before
torch's I sees it: `out.clone()` at the end of the stage's forward (one copy
of the activation per microbatch), or hyperparallel.pipelining.PipelineStage,
whose I and W (GradFunction) detach nothing.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import paired  # noqa: E402
import torch_link  # noqa: E402
from compare import max_rel_diff  # noqa: E402

PP, EP = 2, 2
# The model and the step: a step of ~100-500 ms per side on a 2-core host.
MODEL = dict(hidden=128, intermediate=256, experts=4, top_k=2, layers=4, heads=4, kv_heads=2,
             vocab=256, seq=64, microbatch_size=1, microbatches=8)
# Row: (PyTorch's schedule, our schedule); "ZB-H1" is ours in torch's runtime.
ROWS = {"DualPipeV": "dualpipev", "ZBVZeroBubble": "zbv", "ZB-H1": "zb-h1"}
SIDE_NAMES = {"torch": "PyTorch", "hp-py": "hp Python", "hp-overlap": "hp Python fb_overlap"}


def make_model(seed):
    """The tiny float32 Mixtral, seeded."""
    import torch
    import transformers as tf

    c = MODEL
    config = tf.MixtralConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], num_local_experts=c["experts"],
        num_experts_per_tok=c["top_k"], max_position_embeddings=max(c["seq"], 16),
        tie_word_embeddings=False, attn_implementation="eager",
        experts_implementation="eager")
    torch.manual_seed(seed)
    return tf.MixtralForCausalLM(config).to(torch.float32)


def loss_fn(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def global_batch(step, seed):
    """(inputs, targets) of a step, both copies' rows: EP * m * MB sequences."""
    import torch

    c = MODEL
    g = torch.Generator().manual_seed(1000 * seed + step)
    ids = torch.randint(0, c["vocab"], (EP * c["microbatches"] * c["microbatch_size"],
                                        c["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def ep_chunks(base, sched, stage_rank, ep_group):
    """A deep copy of `base` cut into this rank's chunks of `sched`, its experts
    spread over `ep_group`: {chunk: module}."""
    import hyperparallel as hp

    model = copy.deepcopy(base)
    chunks = hp.pipeline.split_model(model, sched, stage_rank)  # cut first (NOTE in ep_worker)
    hp.moe.expert_parallel(model, ep_group)
    return chunks


class HpEpSide:
    """Ours: Pipeline over the side's pp group, dp_group its EP group."""

    def __init__(self, args, sched, chunks, grid, fb_overlap):
        import torch

        import hyperparallel as hp

        self.sched = sched
        self.pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, group=grid.pp,
                                         dp_group=grid.ep, timeout=args.timeout,
                                         p2p=args.hp_p2p, fb_overlap=fb_overlap)
        self.optimizer = torch.optim.AdamW([q for c in chunks.values() for q in c.parameters()],
                                           lr=args.lr, weight_decay=args.weight_decay)
        self.last_outside = 0.0

    def step(self, x, y):
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = self.pipe.step(x, y)  # the mean over microbatches and copies, every rank
        t2 = time.perf_counter()
        self.optimizer.step()
        self.last_outside = (t1 - t0) + (time.perf_counter() - t2)
        return float(loss)


class TorchEpSide:
    """PyTorch's: its PipelineStages over the same chunks on the side's pp
    group, Schedule<NAME> (or our zb-h1 in its _PipelineScheduleRuntime), then
    the EP group's reduction of NOTE [Expert gradients] by hand."""

    def __init__(self, args, theirs, sched, chunks, grid):
        import torch
        import torch.distributed.pipelining as pp

        import hyperparallel as hp
        from hyperparallel import torch_export

        c = MODEL
        m, rows, T = c["microbatches"], c["microbatch_size"], c["seq"]
        n = sched.num_stages
        self.stages = []
        for st in sorted(chunks):  # chunk i is stage i on these schedules (one route)
            example_in = (torch.zeros(rows, T, dtype=torch.int64) if st == 0
                          else torch.zeros(rows, T, c["hidden"]))
            example_out = torch.zeros(rows, T, c["vocab"] if st == n - 1 else c["hidden"])
            self.stages.append(pp.PipelineStage(chunks[st], st, n, torch.device("cpu"),
                                                input_args=(example_in,),
                                                output_args=(example_out,), group=grid.pp))

        def scaled_loss(out, target):
            return loss_fn(out, target) / m

        if theirs == "ZB-H1":
            # No torch class: our action list in torch's runtime (which also
            # skips the handshake to oneself, NOTE [Gloo and the V turn]).
            self.schedule = torch_export.make_torch_runtime(sched, self.stages, scaled_loss,
                                                            scale_grads=False)
        else:
            torch_export.skip_local_handshake(self.stages)  # NOTE [Gloo and the V turn]
            self.schedule = getattr(pp, "Schedule" + theirs)(self.stages, m, loss_fn=scaled_loss,
                                                             scale_grads=False)
        params = [q for ch in chunks.values() for q in ch.parameters()]
        self.experts = [q for q in params if hp.moe.is_expert_parameter(q)]
        self.plain = [q for q in params if not hp.moe.is_expert_parameter(q)]
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.pp_group, self.ep_group = grid.pp, grid.ep
        self.checked = False

    def step(self, x, y):
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        call_args = (x,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*call_args, target=y, losses=losses)
        else:
            self.schedule.step(*call_args)
        # NOTE [Expert gradients]: the plain parameters averaged over the EP
        # group (one all-reduce of them all), the experts divided by its size.
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in self.plain]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.ep_group)
        flat.div_(EP)
        for q, g in zip(self.plain, _unflatten_dense_tensors(flat, grads)):
            q.grad = g
        for q in self.experts:
            if q.grad is not None:
                q.grad.div_(EP)
        self.optimizer.step()
        loss = torch.tensor([float(sum(v.item() for v in losses))], dtype=torch.float64)
        dist.all_reduce(loss, group=self.pp_group)  # the last stage's rank has it
        dist.all_reduce(loss, group=self.ep_group)
        return float(loss.item()) / EP


def worker(args):
    # Read when a Pipeline or an expert dispatcher is made: set before either.
    if args.link:
        os.environ["HP_LINK"] = args.link
        torch_link.install(*parse_link(args.link))  # PyTorch's transfers pay it too
    else:
        os.environ.pop("HP_LINK", None)
    common.run_worker(args, run_rank)


def parse_link(text):
    """(latency in us, GB/s) of --link LATENCY_US,GBPS, or None when malformed."""
    parts = text.split(",")
    try:
        latency, gbps = (float(v) for v in parts)
    except ValueError:
        return None
    return (latency, gbps) if 0 <= latency <= 1e12 and 0 <= gbps <= 1e12 else None


def describe_link(text):
    """'1000 us, 1 GB/s' of --link 1000,1; 'loopback' of no link."""
    if not text:
        return "loopback"
    latency, gbps = parse_link(text)
    return f"{latency:g} us, " + (f"{gbps:g} GB/s" if gbps > 0 else "unlimited bandwidth")


def run_rank(args, rank, world, torch, dist, error):
    import hyperparallel as hp

    if world != PP * EP:
        raise ValueError(f"paired_ep runs on {PP * EP} ranks, not {world}")
    theirs, ours = args.schedule, ROWS[args.schedule]
    m = MODEL["microbatches"]
    sched = hp.pipeline.schedule(ours, ranks=PP, microbatches=m)
    base = make_model(args.seed)
    names = ["torch", "hp-py"] + (["hp-overlap"] if args.fb_overlap and ours == "dualpipev"
                                  else [])
    sides = {}
    for k in names:
        grid = hp.pipeline.mesh(pp=PP, dp=EP, ep=EP)  # every side its own groups
        chunks = ep_chunks(base, sched, grid.stage_rank, grid.ep)
        error[0] = f"building the {SIDE_NAMES[k]} side ({theirs if k == 'torch' else ours})"
        if k == "torch":
            sides[k] = TorchEpSide(args, theirs, sched, chunks, grid)
        else:
            sides[k] = HpEpSide(args, sched, chunks, grid, fb_overlap=k == "hp-overlap")
    copy_ = grid.copy
    rows = MODEL["microbatches"] * MODEL["microbatch_size"]

    def batch(step):
        x, y = global_batch(step, args.seed)
        return x[copy_ * rows:(copy_ + 1) * rows], y[copy_ * rows:(copy_ + 1) * rows]

    error[0] = "the paired steps"
    with common.Profile(args, rank):
        result, actions, outside = paired.take_turns(args, sides, batch, rank, world, torch,
                                                     dist)
    stats = {}
    for k in names[1:]:
        st = sides[k].pipe.last_stats
        stats[k] = {key: st[key] for key in ("compute", "comm_wait", "overhead")
                    if key in st}
    everyone = [None] * world
    dist.all_gather_object(everyone, {"actions": actions, "outside": outside,
                                      "last_stats": stats, "torch_sends": torch_link.sends()})
    if rank == 0:
        result["last_stats"] = [e["last_stats"] for e in everyone]
        # PyTorch's sends that paid the link, per rank (0 without --link).
        result["torch_link_sends"] = [e["torch_sends"] for e in everyone]
        result.update({"schedule": theirs, "hp_schedule": ours, "nproc": world,
                       "mesh": "pp 2 x ep 2", "torch_version": torch.__version__,
                       "link": os.environ.get("HP_LINK", "")})
        common.write_result(args.out, result)
    dist.barrier()
    dist.destroy_process_group()


def quantile(xs, q):
    return paired.quantile(xs, q)


def summarize(runs, ours_key):
    """PyTorch against one of our sides over a row's runs."""
    pairs, rounds, t_all, h_all, diff = [], [], [], [], 0.0
    cpu_t, cpu_h = [], []
    for r in runs:
        t, h = r["torch"]["step_seconds"][1:], r[ours_key]["step_seconds"][1:]
        ps = [a / b for a, b in zip(t, h)]
        pairs += ps
        rounds.append(statistics.median(ps))
        t_all += t
        h_all += h
        cpu_t += [max(c) for c in r["torch"]["cpu_seconds"][1:]]
        cpu_h += [max(c) for c in r[ours_key]["cpu_seconds"][1:]]
        diff = max(diff, max_rel_diff(r[ours_key]["losses"], r["torch"]["losses"]))
    return {"torch_ms": statistics.median(t_all) * 1e3, "hp_ms": statistics.median(h_all) * 1e3,
            "torch_cpu_ms": statistics.median(cpu_t) * 1e3,
            "hp_cpu_ms": statistics.median(cpu_h) * 1e3,
            "ratio": statistics.median(pairs), "q25": quantile(pairs, 0.25),
            "q75": quantile(pairs, 0.75), "per_round": rounds, "pairs": len(pairs),
            "max_loss_rel_diff": diff}


def link_text(link):
    """The header's words for the link."""
    if not link:
        return "loopback"
    return (f"{describe_link(link)} (HP_LINK) on both sides' expert all-to-alls and our "
            "side's pipeline transfers (over its Gloo group); PyTorch's pipeline sends "
            "through a link of the same (torch_link.py)")


def render(report):
    a, c = report["args"], MODEL
    out = [f"transformers MixtralForCausalLM, float32, hidden {c['hidden']}, "
           f"{c['experts']} experts top {c['top_k']} (expert MLP {c['intermediate']}), "
           f"{c['layers']} layers, seq {c['seq']}, {c['microbatches']} microbatches of "
           f"{c['microbatch_size']} per copy; pp 2 x ep 2 = 4 ranks, experts spread by "
           f"expert_parallel over each EP group; AdamW; {a['steps']} steps x {a['rounds']} "
           f"rounds; our side's p2p={a['hp_p2p']}; link: {link_text(a.get('link', ''))}\n",
           "| PyTorch | hp | PyTorch step ms | hp step ms | PyTorch / hp, paired "
           "(middle half) | per round | CPU ms per step, busiest rank (PyTorch / hp) | "
           "losses agree |",
           "|---|---|---|---|---|---|---|---|"]
    for theirs, row in report["rows"].items():
        if row.get("error") and not row["summary"]:
            err = row["error"].replace("|", "/")
            out.append(f"| {theirs} | {ROWS[theirs]} | failed: {err} | | | | | |")
            continue
        label = {"ZB-H1": "zb-h1 in torch's `_PipelineScheduleRuntime`"}.get(
            theirs, f"`Schedule{theirs}`")
        for key, s in row["summary"].items():
            ours = ROWS[theirs] + (", fb_overlap" if key == "hp-overlap" else "")
            agree = "yes" if s["max_loss_rel_diff"] <= a["tolerance"] else "NO"
            out.append(
                f"| {label} | {ours} | {s['torch_ms']:.1f} | {s['hp_ms']:.1f} | "
                f"{s['ratio']:.2f} ({s['q25']:.2f}-{s['q75']:.2f}) | "
                f"{', '.join(f'{x:.2f}' for x in s['per_round'])} | "
                f"{s['torch_cpu_ms']:.1f} / {s['hp_cpu_ms']:.1f}"
                f"{' *' if key == 'hp-overlap' else ''} | "
                f"{agree} ({s['max_loss_rel_diff']:.1e}) |")
    if any("hp-overlap" in row["summary"] for row in report["rows"].values()):
        out.append("\n\\* the main thread's CPU time only: fb_overlap runs one half of each "
                   "pair on a second thread (they take turns), not counted here.")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps of each side per run")
    ap.add_argument("--schedules", default=",".join(ROWS),
                    help=f"rows, PyTorch's names: {', '.join(ROWS)}")
    ap.add_argument("--fb-overlap", action="store_true",
                    help="the dualpipev row also runs ours with Pipeline(fb_overlap=True)")
    ap.add_argument("--hp-p2p", default="auto", choices=["auto", "group", "shm"])
    ap.add_argument("--link", default="", metavar="LATENCY_US,GBPS",
                    help="every rank under HP_LINK=LATENCY_US,GBPS (a modelled link, "
                         "docs/overlap.md): both sides' expert all-to-alls and pipeline "
                         "transfers pay it (PyTorch's sends through torch_link.py); "
                         "default: loopback")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300)
    # one rank of one row (internal)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--schedule", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="cProfile of each rank's paired steps into DIR/rank<r>.prof")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.worker:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        worker(args)
        common.end_rank()
    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules:
        if s not in ROWS:
            ap.error(f"--schedules: {s!r} is not one of {', '.join(ROWS)}")
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the first is warm-up)")
    if args.link and parse_link(args.link) is None:
        ap.error(f"--link: {args.link!r}: give LATENCY_US,GBPS, two numbers >= 0, "
                 "e.g. 1000,1 for 1 ms and 1 GB/s")
    if args.link and args.hp_p2p == "shm":
        ap.error("--link with --hp-p2p shm: the rings would bypass the link model")

    def argv_of(_setting, name):
        return ["--schedule", name, "--steps", str(args.steps), "--seed", str(args.seed),
                "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
                "--timeout", str(args.timeout), "--hp-p2p", args.hp_p2p,
                *(["--link", args.link] if args.link else []),
                *(["--fb-overlap"] if args.fb_overlap else []),
                *(["--profile", args.profile] if args.profile else []),
                *(["--verbose"] if args.verbose else [])]
    runs, failed, errors = run_rows(args, schedules, argv_of)
    report = {"args": vars(args), "model": MODEL, "rows": {}, "runs": runs, "failed": failed,
              "date": time.strftime("%Y-%m-%d")}
    for name in schedules:
        rs = runs[name]
        keys = [k for k in ("hp-py", "hp-overlap") if rs and k in rs[0]]
        report["rows"][name] = {"summary": {k: summarize(rs, k) for k in keys},
                                "error": errors.get(name)}
    text = render(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    disagree = [f"{n} ({k})" for n, row in report["rows"].items()
                for k, s in row["summary"].items() if s["max_loss_rel_diff"] > args.tolerance]
    if disagree:
        print("losses disagree: " + ", ".join(disagree), file=sys.stderr)
    if failed:
        print("failed runs: " + ", ".join(failed), file=sys.stderr)
    return 1 if disagree or failed else 0


def run_rows(args, schedules, argv_of):
    """paired.run_rows on 4 ranks, one setting; returns ({row: [run, ...]},
    failed, {row: error text})."""
    runs, failed, errors = paired.run_rows(os.path.abspath(__file__), args, ["ep"], schedules,
                                           argv_of, nproc=PP * EP)
    return runs["ep"], failed, {n: e for (_, n), e in errors.items()}


if __name__ == "__main__":
    sys.exit(main())
