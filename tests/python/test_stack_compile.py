"""torch.compile'd chunks and activation checkpointing inside hyperparallel's
Pipeline, on real processes over Gloo in float64: equal to single-process
training to 1e-9, with the compiled backward's runs and the checkpointed
blocks' recomputes counted (NOTE [Compiled stages under a split schedule],
NOTE [Checkpoint under a split schedule] in
python/hyperparallel/pipeline/checks.py). One launch of 2 processes runs
every case."""

import os
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stack_launch as sl  # noqa: E402
import stack_worker as sw  # noqa: E402

# Fused (1f1b, interleaved-1f1b) and split (zb-h1, zb-h2, zbv: two chunks
# per rank, dualpipev: B and I/W mixed, zb-auto) schedules.
COMPILED = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "zb-auto"]
# torch.utils.checkpoint, and "hp-": hyperparallel.recompute.checkpoint.
CHECKPOINTED = ["1f1b", "zb-h1", "hp-zb-h1", "hp-zbv"]
# hyperparallel.compile.GraphStage chunks (graphs replayed; "inductor-":
# each graph compiled by inductor) on fused and split schedules.
GRAPH = ["graph-" + n for n in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv",
                                "dualpipev", "zb-auto", "inductor-zb-h1", "inductor-zbv")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # Both modes read the schedule list; each takes the names it knows.
    return sl.run(2, "compile+checkpoint+graph", COMPILED + CHECKPOINTED + GRAPH,
                  tmp_path_factory.mktemp("compile"))


def schedule_of(name):
    for prefix in ("hp-", "graph-", "inductor-"):
        name = name[len(prefix):] if name.startswith(prefix) else name
    return name, hp.pipeline.schedule(name, ranks=2, microbatches=sw.microbatches(name, 2))


def test_compiled_chunks_equal_single_process_training(ranks):
    for name in COMPILED:
        _, sched = schedule_of(name)
        ref_losses, ref_chunks = sw.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            got = res["compile-" + name]
            sl.assert_equal(got, ref_losses, ref_chunks, f"compiled {name} rank {r}")
            # Runs of the compiled backward per microbatch: once under B; on a
            # split schedule twice (I, then W) where the stage sends a
            # gradient back, once on the route's first stage (no I).
            for c, runs in got["bw_runs"].items():
                where = f"{name} rank {r} chunk {c}: {runs} runs per microbatch"
                if not sched.has_split or c == 0:
                    assert runs == 1.0, where
                elif name == "dualpipev":  # B where it overlaps, I and W elsewhere
                    assert 1.0 < runs < 2.0, where
                else:
                    assert runs == 2.0, where
    split = sum(schedule_of(n)[1].has_split for n in COMPILED)
    for res in ranks:
        said = [w for w in res["warnings-compile"] if "torch.compile'd" in w]
        # One warning per split schedule's Pipeline, none for fused ones.
        assert split == 5 and len(said) == split, res["warnings-compile"]
        assert all("runs whole in I and again in W" in w for w in said), said


def test_checkpointed_blocks_recompute_once_or_say_so(ranks):
    for key in CHECKPOINTED:
        name, sched = schedule_of(key)
        ref_losses, ref_chunks = sw.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            got = res["checkpoint-" + key]
            sl.assert_equal(got, ref_losses, ref_chunks, f"checkpoint {key} rank {r}")
            # Forwards of each chunk's block per microbatch: 1 + recomputes.
            for c, runs in got["runs"].items():
                if key.startswith("hp-") or name == "1f1b" or c == 0:
                    expect = 2.0  # one recompute (chunk 0: no I, only W's)
                else:
                    expect = 3.0  # torch.utils.checkpoint: in I and again in W
                assert runs == expect, f"{key} rank {r} chunk {c}: {runs} runs per microbatch"
    for r, res in enumerate(ranks):
        said = [w for w in res["warnings-checkpoint"] if "torch.utils.checkpoint" in w]
        # Once, for zb-h1 (the split schedule with torch's checkpoint).
        assert len(said) == 1, res["warnings-checkpoint"]
        assert "hyperparallel.recompute.checkpoint recomputes once" in said[0], said


def test_graph_stages_split_their_backward_into_dx_and_dw_graphs_once_each(ranks):
    """NOTE [Graph stages] in python/hyperparallel/compile/stage.py: every
    schedule trains equal to single-process training, and per microbatch
    each stage runs its forward graph once and either its fused backward
    graph or its dx and dw graphs, once each; on a split schedule every stage
    that sends a gradient back runs dx in I and dw in W (never the fused
    graph, never twice)."""
    for key in GRAPH:
        name, sched = schedule_of(key)
        ref_losses, ref_chunks = sw.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            got = res[key]
            sl.assert_equal(got, ref_losses, ref_chunks, f"{key} rank {r}")
            for c, n in got["counts"].items():
                where = f"{key} rank {r} chunk {c}: {n}"
                assert n["capture"] == 1 and n["forward"] == 1.0, where
                assert n["dx"] == n["dw"], where
                assert n["dx"] + n["backward"] == 1.0, where
                if c == 0 or not sched.has_split:
                    assert n["backward"] == 1.0, where  # no I on the route's first stage
                elif name != "dualpipev":  # DualPipeV also runs B where it overlaps
                    assert n["dx"] == 1.0, where
            # Two bias sums in dw and two in the fused graph when replayed;
            # compiled, products (NOTE [Column sums as products]).
            for c, sums in got["sums"].items():
                assert sums == (0 if key.startswith("graph-inductor-") else 4), (key, r, c, sums)
        for res in ranks:
            assert not [w for w in res["warnings-graph"] if "hyperparallel" in w], \
                res["warnings-graph"]
