"""Starts stack_worker.py on real processes (torchrun's variables, Gloo) and
compares what they saved with single-process training: the helpers of
test_stack_*.py."""

import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, mode: str, names, out_dir, timeout=300):
    """Runs `world` ranks of stack_worker.py MODE NAMES; returns every rank's
    saved dict, failing with the ranks' stderr when one exits non-zero."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "stack_worker.py"), str(out_dir), mode,
             ",".join(names)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for pr in procs:
            outs.append(pr.communicate(timeout=timeout))
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    failed = [(r, pr.returncode, outs[r][1]) for r, pr in enumerate(procs) if pr.returncode != 0]
    assert not failed, "\n".join(f"rank {r} exit {rc}:\n{err[-4000:]}" for r, rc, err in failed)
    return [torch.load(os.path.join(str(out_dir), f"rank{r}.pt")) for r in range(world)]


def assert_equal(got, ref_losses, ref_chunks, what, tol=1e-9):
    """Losses and every chunk's full parameters against single-process
    training, to `tol` relative (float64)."""
    assert len(got["losses"]) == len(ref_losses), what
    for s, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what} step {s}: loss {a!r} vs {b!r}"
    for c, tensors in got["chunks"].items():
        assert len(tensors) == len(ref_chunks[c]), what
        for k, (q, q_ref) in enumerate(zip(tensors, ref_chunks[c])):
            assert q.shape == q_ref.shape, f"{what} chunk {c} param {k}: shape {q.shape}"
            err = (q - q_ref).abs().max().item()
            assert err <= tol * max(1.0, q_ref.abs().max().item()), (
                f"{what} chunk {c} param {k}: max error {err}")
