"""Our schedules in torch.distributed.pipelining's action runtime.

The export (hyperparallel.torch_export) is checked three ways: the action
lists against torch's own validator and lowering, the refusals (DualPipe,
out-of-order last-stage forwards) by their messages, and real training: 2 and
4 processes over Gloo run torch's _PipelineScheduleRuntime driven by our
zb-h2, zb-auto, dualpipev, zbv-auto and the other generators, and their
losses and final parameters equal single-process training (plain autograd,
gradients accumulated over the microbatches) to 1e-9 in float64.

Run as a script (``--worker``) this file is one rank of that training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---------------------------------------------------------------------------
# The model, the data and the training both sides run.

WIDTH = 8
LAYERS = 8  # Linear + Tanh pairs; split into S consecutive chunks
BATCH = 16
STEPS = 3
LR = 0.1


def make_layers() -> list[torch.nn.Module]:
    g = torch.Generator().manual_seed(1234)
    layers = []
    for _ in range(LAYERS):
        lin = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64) / WIDTH**0.5)
            lin.bias.copy_(torch.randn(WIDTH, generator=g, dtype=torch.float64) * 0.1)
        layers += [lin, torch.nn.Tanh()]
    return layers


def chunk(layers: list[torch.nn.Module], stage: int, num_stages: int) -> torch.nn.Sequential:
    per = len(layers) // num_stages
    return torch.nn.Sequential(*layers[stage * per : (stage + 1) * per])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference(num_microbatches: int):
    """Single-process training: per-microbatch losses, mean over microbatches."""
    model = torch.nn.Sequential(*make_layers())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        step = []
        for xm, ym in zip(torch.tensor_split(x, num_microbatches), torch.tensor_split(y, num_microbatches)):
            loss = loss_fn(model(xm), ym)
            (loss / num_microbatches).backward()
            step.append(loss.item())
        losses.append(step)
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------
# One rank (run as a script).


def run_rank(rank: int, world: int, store: str, job_path: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    with open(job_path) as f:
        job = json.load(f)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    data = batches()
    results = {}
    for case in job["cases"]:
        S, m, fmt = case["num_stages"], case["microbatches"], case["format"]
        print(f"rank {rank}: case {case['name']}", flush=True)
        layers = make_layers()
        mine = [s for s in range(S) if case["stage_rank"][s] == rank]
        chunks = {s: chunk(layers, s, S) for s in mine}
        stage_cls = PipelineStage
        if case.get("stage") == "hp":
            # hyperparallel's drop-in stage: I and W by our exact split.
            from hyperparallel.pipelining import PipelineStage as stage_cls
        stages = [stage_cls(chunks[s], s, S, torch.device("cpu")) for s in mine]
        if case["via"] == "csv":
            # torch's own loader reads the file we wrote.
            runtime = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
            runtime._load_csv(case["csv"], format=fmt)
            if any(case["stage_rank"][s] == case["stage_rank"][s + 1] for s in range(S - 1)):
                # torch's handshake would send to this rank itself (NOTE [Gloo
                # and the V turn] in hyperparallel/torch_export.py).
                from hyperparallel.torch_export import skip_local_handshake

                skip_local_handshake(stages)
        else:
            # Every rank builds the same schedule (the generators are
            # deterministic) and hands it to the runtime.
            from hyperparallel import schedule as hs
            from hyperparallel import torch_export as te

            sched = hs.from_csv(case["schedule_csv"])
            runtime = te.make_torch_runtime(sched, stages, loss_fn, format=fmt)
        params = [p for s in mine for p in chunks[s].parameters()]
        opt = torch.optim.SGD(params, lr=LR)
        has_first, has_last = 0 in mine, S - 1 in mine
        losses = []
        for x, y in data:
            opt.zero_grad()
            out: list = []
            runtime.step(
                *((x,) if has_first else ()),
                target=y if has_last else None,
                losses=out if has_last else None,
            )
            losses.append([v.item() for v in out])
            opt.step()
        results[case["name"]] = {
            "losses": losses if has_last else None,
            "params": {s: [p.detach().clone() for p in chunks[s].parameters()] for s in mine},
        }
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--store")
    ap.add_argument("--job")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    run_rank(a.rank, a.world, a.store, a.job, a.out)


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py

# ---------------------------------------------------------------------------
# The tests.

import pytest  # noqa: E402

from hyperparallel import schedule as hs  # noqa: E402
from hyperparallel import torch_export as te  # noqa: E402
from torch.distributed.pipelining import schedules as ts  # noqa: E402


def launch(world: int, cases: list[dict], tmp_path) -> dict:
    """Runs the cases on `world` processes; returns {case: {rank: result}}."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases}))
    store = tmp_path / "store"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
             "--world", str(world), "--store", str(store), "--job", str(job), "--out", str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 240
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = "(timed out)"
        outputs.append(out)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n" + "\n".join(
            f"--- rank {i}\n{o[-4000:]}" for i, o in enumerate(outputs)
        )
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    return {c["name"]: {r: per_rank[r][c["name"]] for r in range(world)} for c in cases}


def case(name: str, sched: hs.Schedule, fmt: str, via: str, tmp_path, stage: str = "torch") -> dict:
    c = {
        "name": name,
        "stage": stage,
        "num_stages": sched.num_stages,
        "microbatches": sched.num_microbatches,
        "stage_rank": sched.stage_rank,
        "format": fmt,
        "via": via,
    }
    if via == "csv":
        path = tmp_path / (name.replace("/", "-") + ".csv")
        te.write_torch_csv(sched, path, format=fmt)
        c["csv"] = str(path)
    else:
        c["schedule_csv"] = sched.to_csv()
    return c


def check_against_reference(results: dict, cases: list[dict]) -> None:
    for c in cases:
        S, m = c["num_stages"], c["microbatches"]
        ref_losses, ref_params = reference(m)
        per = len(ref_params) // S
        got = results[c["name"]]
        last_rank = c["stage_rank"][S - 1]
        losses = got[last_rank]["losses"]
        assert len(losses) == STEPS and all(len(l) == m for l in losses), c["name"]
        err = (
            torch.tensor(losses, dtype=torch.float64) - torch.tensor(ref_losses, dtype=torch.float64)
        ).abs().max().item()
        assert err <= 1e-9, f"{c['name']}: losses differ by {err}"
        for s in range(S):
            params = got[c["stage_rank"][s]]["params"][s]
            for p, q in zip(params, ref_params[s * per : (s + 1) * per]):
                err = (p - q).abs().max().item()
                assert err <= 1e-9, f"{c['name']}: stage {s} differs by {err}"
        # The model really trained: parameters moved, losses changed.
        assert losses[0] != losses[-1]


UNIT = hs.CostModel()
SKEWED = hs.CostModel(f=1.0, b=1.3, w=0.6, comm=0.2)


def p2_cases(tmp_path) -> list[dict]:
    p = 2
    scheds = {
        "zb-h2": hs.build("zb-h2", p, 4),
        "zb-auto": hs.build("zb-auto", p, 4, costs=SKEWED, mem_limit="1x"),
        "zb-auto-2x": hs.build("zb-auto", p, 8, costs=SKEWED, mem_limit="2x"),
        "dualpipev": hs.build("dualpipev", p, 4),
        "zbv-auto": hs.build("zbv-auto", p, 4, costs=SKEWED),
        "zb-h1": hs.build("zb-h1", p, 4),
        "interleaved-zb": hs.build("interleaved-zb", p, 4, chunks=2),
        "interleaved-1f1b": hs.build("interleaved-1f1b", p, 4, chunks=2),
        "interleaved-bfs": hs.build("interleaved-bfs", p, 4, chunks=2),
        "1f1b": hs.build("1f1b", p, 4),
        "gpipe": hs.build("gpipe", p, 4),
        "naive": hs.build("naive", p, 2),
    }
    out = []
    for i, (name, s) in enumerate(scheds.items()):
        # Every schedule in both formats, through both entry points over the cases.
        out.append(case(f"{name}/only", s, "compute_only", "csv" if i % 2 else "api", tmp_path))
        out.append(case(f"{name}/comms", s, "compute_comms", "api" if i % 2 else "csv", tmp_path))
    # Our schedules with hyperparallel's own PipelineStage (hyperparallel.pipelining).
    for name in ("zb-auto", "dualpipev"):
        out.append(case(f"{name}/hp-stage", scheds[name], "compute_only", "api", tmp_path, stage="hp"))
    return out


def test_two_ranks_train_like_one_process(tmp_path):
    cases = p2_cases(tmp_path)
    results = launch(2, cases, tmp_path)
    check_against_reference(results, cases)


def test_four_ranks_train_like_one_process(tmp_path):
    p = 4
    # Two cases keep both formats and both loading paths at p = 4 (every
    # exportable schedule runs at p = 2 above); each case costs its share of
    # four processes' start-up and training on the test machine's two cores.
    scheds = {
        "zb-auto": hs.build("zb-auto", p, 8, costs=SKEWED, mem_limit="1.5x"),
        "dualpipev": hs.build("dualpipev", p, 8),
    }
    cases = [
        case("zb-auto/compute_only", scheds["zb-auto"], "compute_only", "csv", tmp_path),
        case("dualpipev/compute_comms", scheds["dualpipev"], "compute_comms", "api", tmp_path),
    ]
    results = launch(p, cases, tmp_path)
    check_against_reference(results, cases)


# ---------------------------------------------------------------------------
# The action lists, without processes.

C = ts._ComputationType
EXPORTABLE = [n for n in hs.names() if n != "dualpipe"]


def without(actions, *kinds):
    return [a for a in actions if a is not None and a.computation_type not in kinds]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8)])
def test_every_generator_but_dualpipe_passes_torchs_checks(p, m):
    for name in EXPORTABLE:
        s = hs.build(name, p, m)
        assert te.torch_export_problem(s) is None, name
        actions = te.to_torch_actions(s)
        # torch's validator accepts the lists and infers our placement.
        mapping = ts._validate_schedule(actions, p, s.num_stages, m)
        assert mapping == dict(enumerate(s.stage_rank)), name
        # torch's own lowering places its SEND/RECV and its simulator runs them
        # to the end. Its simulator does not know OVERLAP_F_B (dualpipev and the
        # -fb variants), so a pair goes in as its F then its B: the order the
        # pair's halves may take when nothing overlaps.
        lowered = ts._add_send_recv(
            {r: pairs_in_order(a) for r, a in actions.items()},
            lambda st: s.stage_rank[st],
            s.num_stages,
        )
        ts._simulate_comms_compute(lowered, lambda st: s.stage_rank[st], s.num_stages)


def pairs_in_order(actions):
    out = []
    for a in actions:
        if a is not None and a.computation_type == C.OVERLAP_F_B:
            out.extend(a.sub_actions)
        else:
            out.append(a)
    return out


@pytest.mark.parametrize(
    "torch_name,ours,p,m",
    [
        ("InterleavedZeroBubble", "interleaved-zb", 2, 4),
        ("InterleavedZeroBubble", "interleaved-zb", 4, 8),
        ("ZBVZeroBubble", "zbv", 4, 8),
        ("Interleaved1F1B", "interleaved-1f1b", 4, 8),
        ("DualPipeV", "dualpipev", 4, 8),
        ("GPipe", "gpipe", 4, 8),
    ],
)
def test_torchs_own_generators_give_our_lists(torch_name, ours, p, m):
    # docs/schedules.md: interleaved-zb is PyTorch's ScheduleInterleavedZeroBubble
    # construction, zbv its ScheduleZBVZeroBubble (zbv-auto's first candidate),
    # DualPipeV and Interleaved1F1B follow the same papers. torch builds them
    # here itself.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    per_rank = None if torch_name == "GPipe" else 2
    theirs = dict(enumerate(get_schedule_ops(torch_name, p, m, num_stages_per_rank=per_rank)))
    s = hs.build(ours, p, m, chunks=2)
    mine = te.to_torch_actions(s)
    for r in range(p):
        assert mine[r] == without(theirs[r], C.REDUCE_GRAD), (torch_name, r)
    assert te.from_torch_actions(theirs, name=ours) == s


def test_csv_is_what_torchs_loader_reads(tmp_path):
    import csv

    for name in ("zb-h2", "dualpipev", "zbv"):
        s = hs.build(name, 2, 4)
        for fmt in te.FORMATS:
            path = tmp_path / f"{name}-{fmt}.csv"
            te.write_torch_csv(s, path, format=fmt)
            # PipelineScheduleMulti._load_csv's reading, line for line.
            with open(path, newline="") as f:
                rows = {r: [ts._Action.from_str(x) for x in row] for r, row in enumerate(csv.reader(f))}
            assert rows == te.to_torch_actions(s, format=fmt), (name, fmt)


def test_compute_comms_lists():
    for name in ("zb-h2", "zb-auto", "dualpipev", "interleaved-zb"):
        s = hs.build(name, 4, 8)
        only = te.to_torch_actions(s)
        comms = te.to_torch_actions(s, format="compute_comms")
        assert te.to_torch_actions(hs.lower(s), format="compute_comms") == comms
        assert te.to_torch_actions(hs.lower(s)) == only  # SEND/RECV dropped again
        sends, recvs = {}, {}
        for r, acts in comms.items():
            assert [a for a in acts if a.is_compute_op] == only[r], name
            # REDUCE_GRAD once per stage, after its last backward.
            for st in s.stages_of_rank(r):
                idx = [i for i, a in enumerate(acts) if a == ts._Action(st, C.REDUCE_GRAD, None)]
                assert len(idx) == 1, (name, r, st)
                last_bw = max(
                    i for i, a in enumerate(acts)
                    for leaf in (a.sub_actions or (a,))
                    if leaf.stage_index == st and leaf.computation_type in (C.BACKWARD_WEIGHT, C.FULL_BACKWARD)
                )
                assert idx[0] > last_bw
            for a in acts:
                if a.computation_type in (C.SEND_F, C.SEND_B):
                    sends.setdefault(r, []).append(a)
                if a.computation_type in (C.RECV_F, C.RECV_B):
                    recvs.setdefault(r, []).append(a)
        # Torch's naming: SEND names the producer, RECV the consumer, the
        # neighbour on the route; every message is received exactly once, on
        # the neighbour's rank, in the order it was sent on that channel.
        for src, acts in sends.items():
            for dst in range(s.num_ranks):
                out = [
                    (a.computation_type == C.SEND_F, a.stage_index + (1 if a.computation_type == C.SEND_F else -1), a.microbatch_index)
                    for a in acts
                    if s.stage_rank[a.stage_index + (1 if a.computation_type == C.SEND_F else -1)] == dst
                ]
                back = [
                    (a.computation_type == C.RECV_F, a.stage_index, a.microbatch_index)
                    for a in recvs.get(dst, [])
                    if s.stage_rank[a.stage_index + (-1 if a.computation_type == C.RECV_F else 1)] == src
                ]
                assert out == back, (name, src, dst)
                assert all(s.stage_rank[st] != src for _, st, _ in out)


def test_dualpipe_is_refused_with_the_reason():
    s = hs.build("dualpipe", 4, 8)
    why = te.torch_export_problem(s)
    assert "2 routes" in why and "stages 0..S-1 in order" in why
    assert "copies of the same model chunk" in why
    for fn in (te.to_torch_actions, te.to_torch_csv, te.check_torch_exportable):
        with pytest.raises(ValueError, match="cannot export to torch.distributed.pipelining: .*2 routes"):
            fn(s)
    with pytest.raises(ValueError, match="2 routes"):
        te.make_torch_runtime(s, [], None)


def test_other_inexpressible_schedules_are_refused():
    # Valid for us: rank 1 runs microbatch 1's forward first. torch keys the
    # last stage's losses by the order of its forwards, so it would mix them up.
    s = hs.Schedule(2, 2, ["0F0 0F1 0B1 0B0", "1F1 1F0 1B1 1B0"], name="swapped")
    hs.validate(s)
    with pytest.raises(ValueError, match=r"last stage 1 \(rank 1\) in microbatch order \[1, 0\]"):
        te.to_torch_actions(s)
    # Stages numbered against the route.
    back = hs.Schedule(2, 1, ["0F0 0B0", "1F0 1B0"], routes=[[1, 0]])
    hs.validate(back)
    with pytest.raises(ValueError, match=r"through stages \[1, 0\]"):
        te.to_torch_actions(back)
    # Two stages computing one chunk (replicas).
    twins = hs.Schedule(2, 1, ["0F0 0B0", "1F0 1B0"], stage_chunk=[0, 0])
    hs.validate(twins)
    with pytest.raises(ValueError, match=r"same model chunk on stages \[\[0, 1\]\]"):
        te.to_torch_actions(twins)
    # An invalid schedule is our ValueError first.
    with pytest.raises(ValueError, match="invalid schedule"):
        te.to_torch_actions(hs.Schedule(2, 1, ["0F0", "1F0 1B0"]))


def test_bad_inputs():
    s = hs.build("zb-h2", 2, 4)
    with pytest.raises(ValueError, match="format must be one of"):
        te.to_torch_actions(s, format="csv")
    with pytest.raises(TypeError, match="hyperparallel Schedule"):
        te.to_torch_actions("zb-h2")
    with pytest.raises(TypeError, match="PipelineStage"):
        te.make_torch_runtime(s, "stages", None)
    with pytest.raises(TypeError, match="PipelineStage"):
        te.make_torch_runtime(s, [object()], None)

    class FakeStage:
        def __init__(self, index, num_stages=2, rank=0, size=2):
            self.stage_index, self.num_stages = index, num_stages
            self.group_rank, self.group_size = rank, size

    with pytest.raises(ValueError, match=r"rank 0 was given stages \[1\] but the schedule places stages \[0\]"):
        te.make_torch_runtime(s, [FakeStage(1)], None)
    with pytest.raises(ValueError, match="made with num_stages=4"):
        te.make_torch_runtime(s, [FakeStage(0, num_stages=4)], None)
    with pytest.raises(ValueError, match="process group has 3"):
        te.make_torch_runtime(s, [FakeStage(0, size=3)], None)
    with pytest.raises(TypeError, match="_PipelineScheduleRuntime"):
        te.load_into_runtime(object(), s)
    with pytest.raises(TypeError):
        te.from_torch_actions([[]])
    A = ts._Action
    with pytest.raises(ValueError, match="only an F beside a full backward"):
        te.from_torch_actions({0: [A(-1, C.OVERLAP_F_B, None, (A(0, C.FORWARD, 0), A(1, C.BACKWARD_INPUT, 0)))]})
    with pytest.raises(ValueError, match="stage 0 has actions on rank 0 and rank 1"):
        te.from_torch_actions({0: [A(0, C.FORWARD, 0)], 1: [A(0, C.FULL_BACKWARD, 0)]})
    with pytest.raises(ValueError, match="invalid schedule"):
        te.from_torch_actions({0: [A(0, C.FORWARD, 0)]})


def test_skip_local_handshake_keeps_only_other_ranks():
    from types import SimpleNamespace as NS

    ops = [NS(group_peer=1), NS(group_peer=0), NS(group_peer=1)]
    stage = NS(group_rank=1, _get_init_p2p_neighbors_ops=lambda: list(ops))
    te.skip_local_handshake([stage])
    te.skip_local_handshake([stage])  # idempotent
    assert [o.group_peer for o in stage._get_init_p2p_neighbors_ops()] == [0]
