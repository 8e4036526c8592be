"""Starts stack_worker.py on real processes (torchrun's variables, Gloo) and
compares what they saved with single-process training: the helpers of
test_stack_*.py."""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ranks  # noqa: E402


def run(world: int, mode: str, names, out_dir, timeout=300):
    """Runs `world` ranks of stack_worker.py MODE NAMES; returns every rank's
    saved dict, failing with the ranks' stderr when one exits non-zero."""
    ranks.run_ranks(world, [os.path.join(HERE, "stack_worker.py"), out_dir, mode, ",".join(names)],
                    timeout=timeout)
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
