"""Mistakes in building a Pipeline and in its step()'s arguments are one clear
error on every rank, quickly, never a hang or a silent difference (NOTE
[Ranks agree on their compositions] in python/hyperparallel/pipeline/checks.py,
NOTE [Arguments of a step] in python/hyperparallel/pipeline/stage_forward.py).
Two real ranks, every case in one launch (step_fault_worker.py)."""

import os
import re

import pytest
import ranks

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def lines():
    outs = ranks.run_ranks(2, [os.path.join(HERE, "step_fault_worker.py")], timeout=120)
    return [out for out, _ in outs]


def event(out, rank, case, what):
    """(seconds, message) of the line 'rank R: CASE WHAT after S s: MESSAGE'."""
    m = re.search(rf"^rank {rank}: {case} {what} after ([0-9.]+) s:? ?(.*)$", out, re.M)
    assert m, f"no '{case} {what}' line of rank {rank} in:\n{out}"
    return float(m.group(1)), m.group(2)


def both(lines, case, what):
    return [event(lines[r], r, case, what) for r in (0, 1)]


def test_a_dp_group_over_the_pipelines_own_ranks_is_refused_on_every_rank(lines):
    for waited, why in both(lines, "dp_world", "construction failed"):
        assert "dp_group has ranks [0, 1], which holds other ranks of the pipeline's group" in why
        assert waited < 10


def test_tensor_parallel_layers_over_the_pipelines_ranks_are_refused_when_made(lines):
    for waited, why in both(lines, "tp_over_pp", "construction failed"):
        assert "DTensor parameter sharded over mesh dimension 0 (ranks [0, 1])" in why, why
        assert waited < 10


def test_fsdp2_on_one_data_parallel_copy_only_is_refused_when_made(lines):
    for waited, why in both(lines, "fsdp_one_copy", "construction failed"):
        assert "rank 0's Pipeline uses FSDP2's mesh of chunk 0 over ranks [0, 1], but rank 1" \
            in why, why
        assert waited < 10


def test_a_rank_whose_arguments_are_refused_ends_its_peers_step_at_once(lines):
    # Declared shape, second step: rank 1 is already in the step when rank 0's
    # batch is refused; rank 0 lives on (the next cases run in the same process).
    (_, why0), (waited, why1) = both(lines, "refused", "step failed")
    assert "not divisible by the 2 microbatches" in why0
    assert waited < 3, f"rank 1 waited {waited} s"
    assert "rank 0's step() refused its arguments: inputs: the batch's first dimension (3)" \
        in why1, why1
    for _, again in both(lines, "refused", "next step failed"):
        assert "a previous step failed on this rank" in again


def test_a_keyword_argument_no_stage_takes_is_an_error_before_any_communication(lines):
    (waited, why0), (_, why1) = both(lines, "typo", "step failed")
    assert "keyword argument(s) ['attn_mask'] are taken by no stage" in why1, why1
    assert "rank 1's step() refused its arguments" in why0 and waited < 3, why0


@pytest.mark.parametrize("case,text", [
    ("one_sided", "rank 0: attention_mask=tensor[4] float64; rank 1: no keyword arguments"),
    ("constants", "rank 0: shift=0.25; rank 1: shift=0.5"),
])
def test_keyword_arguments_that_differ_across_ranks_are_one_error_and_the_pipeline_lives(
        lines, case, text):
    for _, why in both(lines, case, "step failed"):
        assert "step()'s keyword arguments differ across the pipeline's ranks: " + text in why
    both(lines, case, "next step ran")


def test_arguments_refused_while_shapes_are_found_stop_every_rank_and_keep_the_pipeline(lines):
    (_, why0), (_, why1) = both(lines, "no_targets", "step failed")
    assert "rank 1 runs a route's last stage: give step() the targets" in why1
    assert "rank 1's step() refused its arguments: rank 1 runs a route's last stage" in why0
    both(lines, "no_targets", "next step ran")


def test_keyword_arguments_changed_on_one_rank_later_are_caught(lines):
    for _, why in both(lines, "changed", "step failed"):
        assert "rank 0: attention_mask=tensor[4] float64; rank 1: no keyword arguments" in why
