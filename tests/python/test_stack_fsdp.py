"""FSDP2 (fully_shard) stages in hyperparallel's Pipeline, on real processes
over Gloo in float64: losses and every chunk's full parameters after several
SGD steps equal single-process training to 1e-9 (NOTE [FSDP2 stages] in
python/hyperparallel/pipeline/fsdp2.py). One launch of 4 processes runs the whole
schedule matrix; another the bad compositions, each refused on every rank."""

import os
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stack_launch as sl  # noqa: E402
import stack_worker as sw  # noqa: E402

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

# Every schedule family with I/W or B: fused (1f1b, interleaved), split
# (zb-h1, zb-h2, zbv, dualpipev, zb-auto).
SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "zb-auto"]


def check_ranks(ranks, key, name, dp=2, p=2):
    sched = hp.pipeline.schedule(name, ranks=p, microbatches=sw.microbatches(name, p))
    ref_losses, ref_chunks = sw.reference(sched.num_chunks, dp * sched.num_microbatches)
    seen = set()
    for world_rank, res in enumerate(ranks):
        got = res[key]
        assert sorted(got["chunks"]) == sched.chunks_of_rank(world_rank % p), key
        seen.update(got["chunks"])
        sl.assert_equal(got, ref_losses, ref_chunks, f"{key} rank {world_rank}")
    assert seen == set(range(sched.num_chunks)), key


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    """One launch of 4 processes for every test of this file: the schedule
    matrix, FSDP2 beside dp_group, then the bad compositions."""
    return sl.run(4, "fsdp+mixed+bad", SCHEDULES, tmp_path_factory.mktemp("fsdp"))


def test_fully_sharded_chunks_equal_single_process_training_on_every_schedule(fsdp_ranks):
    # pp = 2 x dp = 2: each chunk's two linears and the chunk fully_shard'ed
    # over "dp" (nested FSDP2 groups; Linear(6, 5): dim 0 of 5 rows shards
    # unevenly, 3 + 2), the Pipeline over "pp", no dp_group: FSDP2 averages
    # the gradients and the loss is averaged over its ranks.
    for name in SCHEDULES:
        check_ranks(fsdp_ranks, name, name)
    assert not any(r["warnings-fsdp"] for r in fsdp_ranks), fsdp_ranks[0]["warnings-fsdp"]


def test_fsdp2_beside_dp_group_equals_single_process_training(fsdp_ranks):
    # In each chunk `up` is fully_shard'ed over "dp" and `down` is plain:
    # dp_group's reducer averages `down`, FSDP2 reduce-scatters `up`.
    for name in sw.MIXED:
        check_ranks(fsdp_ranks, "mixed-" + name, name)


def test_bad_fsdp2_compositions_fail_on_every_rank_before_the_first_step(fsdp_ranks):
    for r, res in enumerate(fsdp_ranks):
        err = res["mesh-is-pp"]["error"]
        assert err and err.startswith("ValueError") and "holds other ranks of the pipeline" in err
        err = res["fsdp-and-dp-group"]["error"]
        assert err and "dp_group and FSDP2 would reduce the same parameters" in err, err
        err = res["dp-group-other-ranks"]["error"]
        assert err and "would average over different copies" in err, err
        err = res["replicated"]["error"]
        assert err and "held by several ranks of the schedule" in err, err
        # Only the pipelines' rank 0 (world ranks 0 and 2) sharded over "pp":
        # they say why, the others name the lowest refusing rank.
        err = res["one-rank-bad"]["error"]
        assert err and err.startswith("ValueError"), err
        if r % 2 == 0:
            assert "holds other ranks of the pipeline" in err, err
        else:
            assert "rank 0 refused this Pipeline" in err, err
    # The refusals left the groups usable: a good pipeline trains right after.
    check_ranks(fsdp_ranks, "after-errors", "zb-h1")
    check_ranks(fsdp_ranks, "fsdp-messages", "zb-h1")  # nothing declared
