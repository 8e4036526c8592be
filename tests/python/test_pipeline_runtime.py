"""The Python runtime against its oracle: for every schedule and p in {2, 4},
real processes (started as torchrun starts them) train a float64 model with
hyperparallel's executor over a Gloo group that torch.distributed made; the
losses and every chunk's parameters must equal single-process training."""

import os
import subprocess
import sys

import pytest
import torch

import hyperparallel as hp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline_model as pm  # noqa: E402
import ranks  # noqa: E402

# Every generator but afab (an alias of gpipe).
SCHEDULES = [
    "naive", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-fb", "interleaved-bfs",
    "interleaved-zb", "zb-h1", "zb-h2", "zbv", "zbv-fb", "dualpipe", "dualpipev", "zb-auto",
    "zbv-auto", "v-min", "v-half",
    "v-zb", "auto",
]


def run_ranks(p: int, args, tmp_path, timeout=600, check=True, prefix=None):
    """p ranks of pipeline_worker.py OUT_DIR ARGS (ranks.run_ranks)."""
    return ranks.run_ranks(p, [os.path.join(HERE, "pipeline_worker.py"), tmp_path, *args],
                           timeout=timeout, check=check, prefix=prefix)


def assert_equals_reference(got, ref_losses, ref_chunks, what):
    """One rank's saved result (losses and chunk parameters) against
    single-process training, to 1e-9 relative (float64)."""
    for s, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"{what} step {s}: {a} vs {b}"
    for c, tensors in got["chunks"].items():
        for q, q_ref in zip(tensors, ref_chunks[c]):
            err = (q - q_ref).abs().max().item()
            assert err <= 1e-9 * max(1.0, q_ref.abs().max().item()), (
                f"{what} chunk {c}: max error {err}")


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_single_process_training(p, tmp_path):
    # Pipeline's default p2p ("auto"): shared-memory rings between the ranks
    # that the schedule's transfers join, beside the Gloo group.
    run_ranks(p, [",".join(SCHEDULES)], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in SCHEDULES:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, sched.num_microbatches)
        seen = set()
        for r, res in enumerate(ranks):
            got = res[name]
            assert (got["backend"], got["p2p"]) == ("gloo+shm", "shm"), got["backend"]
            # keep_freed_memory's default on the CPU: the steps ran with the step cache.
            assert got["cpu_cache_bytes"] > 0, f"{name} rank {r}"
            assert sorted(got["chunks"]) == sched.chunks_of_rank(r), name
            seen.update(got["chunks"])
            assert_equals_reference(got, ref_losses, ref_chunks, f"{name} p={p} rank {r}")
        assert seen == set(range(sched.num_chunks)), name


@pytest.mark.parametrize("names", [["1f1b", "zbv", "dualpipe", "dualpipev", "zb-auto"]])
def test_pipeline_times_data_parallel_equals_single_process_training(names, tmp_path):
    # pp = 2 x dp = 2 on 4 real processes (torch's DeviceMesh makes the
    # groups): each copy trains on its half of the global batch; gradients are
    # averaged over dp. Equal to one process on the whole global batch.
    p, dp = 2, 2
    run_ranks(p * dp, [",".join(names), str(dp)], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p * dp)]
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, dp * sched.num_microbatches)
        for world_rank, res in enumerate(ranks):
            got, r = res[name], world_rank % p
            assert got["backend"] == "gloo+shm", got["backend"]  # p2p="auto" beside the mesh's pp group
            assert sorted(got["chunks"]) == sched.chunks_of_rank(r), name
            assert_equals_reference(got, ref_losses, ref_chunks, f"{name} rank {world_rank}")


@pytest.mark.parametrize("lookahead,p2p,backend", [(1, "group", "gloo"), (3, "auto", "gloo+shm")])
def test_receives_posted_ahead_equal_single_process_training(lookahead, p2p, backend, tmp_path):
    # The default (none ahead) runs in every test above; here one batch ahead
    # over Gloo and three over the rings of the default p2p, with malloc left
    # as it is and no step cache (NOTE [Receives posted ahead] in
    # hp/pipeline/executor.cpp).
    names, p = ["1f1b", "interleaved-zb", "zbv", "dualpipev"], 2
    run_ranks(p, [",".join(names), "1", "cpu", str(lookahead), p2p], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            assert res[name]["backend"] == backend, res[name]["backend"]
            assert res[name]["cpu_cache_bytes"] == 0, "keep_freed_memory=False: no step cache"
            assert_equals_reference(res[name], ref_losses, ref_chunks,
                                    f"{name} lookahead {lookahead} rank {r}")


@pytest.mark.parametrize("p2p,dp,backend", [("group", 1, "gloo"), ("shm", 2, "gloo+shm")])
def test_each_point_to_point_equals_single_process_training(p2p, dp, backend, tmp_path):
    # Pipeline(p2p=...) given: "group" is the Gloo group's own point-to-point;
    # "shm" insists on the shared-memory rings (NOTE [Shared-memory
    # point-to-point] in hp/distributed/shm_p2p.cpp); with dp = 2 the rings
    # sit beside a subgroup of the world and the replicas' all-reduce stays
    # on Gloo.
    names, p = ["1f1b", "interleaved-zb", "zbv", "dualpipev", "zb-auto"], 2
    run_ranks(p * dp, [",".join(names), str(dp), "cpu", "0", p2p], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p * dp)]
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, dp * sched.num_microbatches)
        for world_rank, res in enumerate(ranks):
            got = res[name]
            assert got["backend"] == backend, got["backend"]
            assert_equals_reference(got, ref_losses, ref_chunks, f"{name} {p2p} rank {world_rank}")


def small_dev_shm_or_skip():
    """A command prefix that runs its command in a mount namespace of its own
    with a 16 MiB /dev/shm (less than one 32 MiB ring); skips loudly where
    this machine does not allow it."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=16m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("cannot make a small /dev/shm here (unshare -m and mount need root with "
                    f"CAP_SYS_ADMIN: {probe.stderr.strip()[:200]}): Pipeline(p2p=...) with a "
                    "/dev/shm without room is NOT tested on this machine")
    return ["unshare", "-m", "sh", "-c",
            'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]


@pytest.mark.parametrize("small", ["every rank", "rank 1"])
def test_shared_memory_without_room_is_an_error_on_every_rank(small, tmp_path):
    # A /dev/shm smaller than the rings (a container's default is 64 MiB),
    # for every rank or for rank 1 alone: Pipeline(p2p="shm") fails on every
    # rank at construction - the rank without room names /dev/shm, the others
    # name that rank - instead of a SIGBUS mid-step or a rank left waiting
    # (NOTE [Rings take their memory up front], NOTE [Ranks agree on the
    # rings] in hp/distributed/shm_p2p.cpp).
    prefix = small_dev_shm_or_skip()
    outs = run_ranks(2, ["1f1b", "1", "cpu", "0", "shm"], tmp_path, timeout=300, check=False,
                     prefix=lambda r: prefix if small == "every rank" or r == 1 else [])
    for r, (code, _, err) in enumerate(outs):
        assert code != 0 and "RuntimeError" in err, err[-2000:]
        if small == "every rank" or r == 1:
            assert "cannot reserve 32 MiB" in err and "in /dev/shm" in err, err[-2000:]
        else:
            assert "rank 1 could not make its rings" in err, err[-2000:]
        assert not (tmp_path / f"rank{r}.pt").exists()


def test_auto_falls_back_to_the_group_when_a_rank_has_no_room(tmp_path):
    # Pipeline's default p2p="auto" where rank 1's /dev/shm cannot hold a
    # ring: every rank warns with the reason and trains over the Gloo group,
    # equal to single-process training.
    prefix = small_dev_shm_or_skip()
    names, p = ["1f1b", "zbv"], 2
    outs = run_ranks(p, [",".join(names)], tmp_path, timeout=300,
                     prefix=lambda r: prefix if r == 1 else [])
    for r, (_, err) in enumerate(outs):
        assert "RuntimeWarning: Pipeline(p2p='auto') uses the group's point-to-point" in err, err
        assert ("cannot reserve 32 MiB" if r == 1 else "rank 1 could not make its rings") in err
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            assert (res[name]["backend"], res[name]["p2p"]) == ("gloo", "group")
            assert_equals_reference(res[name], ref_losses, ref_chunks, f"{name} auto rank {r}")


CUDA_REASON = (
    "CUDA is not available (torch.cuda.is_available() is False): two ranks sharing one GPU "
    "(CUDA stages, transfers staged through host memory over Gloo) are NOT tested on this "
    "machine; the CPU case runs the same pipelines, and tests/distributed's HostStaging tests "
    "check the staging on the CPU; run tests/python on a GPU machine (scripts/gpu_check.sh)"
)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason=CUDA_REASON)),
])
def test_two_ranks_on_one_device_equal_single_process_training(device, tmp_path):
    # Both ranks on device 0 (on CUDA: NCCL refuses two ranks on one GPU, so
    # the runtime stages through host memory over the Gloo group).
    names, p = ["1f1b", "zbv", "dualpipev", "zb-auto"], 2
    run_ranks(p, [",".join(names), "1", device], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=pm.microbatches(name, p))
        ref_losses, ref_chunks = pm.reference(sched.num_chunks, sched.num_microbatches)
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["device"] == ("cpu" if device == "cpu" else "cuda:0"), got["device"]
            assert_equals_reference(got, ref_losses, ref_chunks, f"{name} {device} rank {r}")


def test_schedule_names_cover_every_generator():
    # The list above is every generator the library has (afab is gpipe's alias).
    names = set(SCHEDULES) | {"afab"}
    for name in names:
        hp.pipeline.schedule(name, ranks=2, microbatches=pm.microbatches(name, 2))
    with pytest.raises(ValueError, match="no-such"):
        hp.pipeline.schedule("no-such", ranks=2, microbatches=4)
