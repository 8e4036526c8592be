"""AutoOverlapPass: communication hidden behind compute (seed 002 §8).

1. Every wait_tensor moves to just before the first node that reads its
   result, so the compute between a collective's issue and that point runs
   while the transfer is in flight (a reduce-scatter issued where its
   gradient is produced is waited for at the output).
2. All-gathers of parameters (their input is a placeholder, so they may be
   issued anywhere earlier) are issued `prefetch` ahead: ordered by their
   wait, the i-th is issued just before the wait of the (i - prefetch)-th,
   the first `prefetch` at the top. prefetch=None issues every first
   gather of a parameter at the top (most overlap, every gathered parameter
   held at once); a second gather of one (reshard-after-forward's, for the
   backward) is always issued one wait ahead.

Every rank runs the same pass on the same graph, so the ranks issue their
collectives in one order.
"""

from __future__ import annotations

from typing import Optional

from ._collectives import ALL_GATHER, is_wait
from .base import GraphPass

__all__ = ["AutoOverlapPass"]


class AutoOverlapPass(GraphPass):
    name = "auto_overlap"

    def __init__(self, prefetch: Optional[int] = 1):
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"AutoOverlapPass: prefetch is {prefetch}; give >= 1 or None")
        self.prefetch = prefetch

    def __repr__(self) -> str:
        return f"AutoOverlapPass(prefetch={self.prefetch})"

    @staticmethod
    def _find_wait_nodes(graph):
        return [n for n in graph.nodes if is_wait(n)]

    @staticmethod
    def _move_wait_later(graph, wait) -> None:
        """Moves `wait` to just before its first reader in graph order."""
        index = {n: i for i, n in enumerate(graph.nodes)}
        if not wait.users:
            return
        first = min(wait.users, key=lambda u: index[u])
        if index[first] > index[wait] + 1:
            first.prepend(wait)

    def run(self, gm, **context):
        graph = gm.graph
        for w in self._find_wait_nodes(graph):
            self._move_wait_later(graph, w)
        # Parameter all-gathers, in the order of their waits: those whose
        # input is a placeholder, or a bucket's shards concatenated (NOTE
        # [FSDP buckets] in fsdp.py), which move with their gather.
        index = {n: i for i, n in enumerate(graph.nodes)}
        pairs = []
        for w in self._find_wait_nodes(graph):
            c = w.args[0]
            if getattr(c, "target", None) == ALL_GATHER and _of_placeholders(c.args[0]):
                pairs.append((index[w], c, w))
        pairs.sort(key=lambda t: t[0])
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        top = placeholders[-1]
        ahead = self.prefetch or 1
        seen = set()
        for i, (_, c, _) in enumerate(pairs):
            # A placeholder's second gather (reshard-after-forward's backward
            # one) is never hoisted to the top: that would hold it all forward.
            first = c.args[0] not in seen
            seen.add(c.args[0])
            if (self.prefetch is None and first) or i < ahead:
                _place(graph, c, top.next)
                top = c
            else:
                _place(graph, c, pairs[i - ahead][2])
        graph.lint()
        gm.recompile()
        return gm


def _of_placeholders(node) -> bool:
    """Whether `node` is a placeholder or computed from placeholders alone."""
    if node.op == "placeholder":
        return True
    return node.op == "call_function" and all(_of_placeholders(a) for a in node.all_input_nodes)


def _place(graph, gather, before) -> None:
    """Moves `gather` just before `before`, with the nodes computing its input
    that stand at or after that point (a bucket's flattened shards and their
    concatenation), in order."""
    chain, todo = set(), list(gather.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.op != "placeholder" and n not in chain:
            chain.add(n)
            todo.extend(n.all_input_nodes)
    while before in chain:  # those already in place stay
        before = before.next
    if before is gather:
        return
    index = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(chain, key=index.get):
        if index[n] >= index[before]:
            before.prepend(n)
    before.prepend(gather)
