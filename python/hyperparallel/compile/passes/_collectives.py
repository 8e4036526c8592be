"""The functional collectives the passes insert and recognise
(torch.ops._c10d_functional: issue returns at once, wait_tensor blocks)."""

from __future__ import annotations

import torch

_ops = torch.ops._c10d_functional
ALL_GATHER = _ops.all_gather_into_tensor.default
REDUCE_SCATTER = _ops.reduce_scatter_tensor.default
ALL_REDUCE = _ops.all_reduce.default
WAIT = _ops.wait_tensor.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)


def is_collective(node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVES


def is_wait(node) -> bool:
    return node.op == "call_function" and node.target == WAIT


def output_list(gm) -> list:
    """The graph's output nodes as a list (the joint graph returns a list)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return out, list(out.args[0])
