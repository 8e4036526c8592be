"""HSDP and DTensor tensor parallelism inside hyperparallel's Pipeline, on 8
real processes over Gloo in float64 (one launch): pp 2 x HSDP (replicate 2 x
shard 2), pp 2 x tp 2 (Colwise/Rowwise linears), and pp 2 x dp 2 x tp 2 with
each TP chunk fully_shard'ed over "dp"; losses and every full parameter after
3 SGD steps equal single-process training to 1e-9, on split schedules (I and
W): zb-h1 for each, zbv too for FSDP2 x TP."""

import os
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stack_launch as sl  # noqa: E402
import stack_worker as sw  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return sl.run(8, "hsdp+tp", [], tmp_path_factory.mktemp("parallel"))


def check(ranks, key, name, dp, h):
    p = 2
    sched = hp.pipeline.schedule(name, ranks=p, microbatches=sw.microbatches(name, p))
    ref_losses, ref_chunks = sw.reference(sched.num_chunks, dp * sched.num_microbatches, h=h)
    for world_rank, res in enumerate(ranks):
        got = res[key]
        # "pp" is the last mesh dimension: the pipeline rank is world rank mod 2.
        assert sorted(got["chunks"]) == sched.chunks_of_rank(world_rank % p), key
        sl.assert_equal(got, ref_losses, ref_chunks, f"{key} rank {world_rank}")


def test_hsdp_chunks_equal_single_process_training(ranks):
    check(ranks, "hsdp-" + sw.STACKED[0], sw.STACKED[0], dp=4, h=sw.H)


def test_tensor_parallel_chunks_equal_single_process_training(ranks):
    check(ranks, "tp-" + sw.STACKED[0], sw.STACKED[0], dp=1, h=sw.TP_H)


@pytest.mark.parametrize("name", sw.STACKED)
def test_fully_sharded_tensor_parallel_chunks_equal_single_process_training(ranks, name):
    check(ranks, "fsdp-tp-" + name, name, dp=2, h=sw.TP_H)
    assert not any(w for r in ranks for k, ws in r.items() if k.startswith("warnings")
                   for w in ws), ranks[0]
