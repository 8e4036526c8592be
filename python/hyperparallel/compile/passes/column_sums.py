"""ColumnSumsAsProducts: a bias's gradient as one matrix-vector product.

Torch-free at import, like the other passes."""

from __future__ import annotations

from .base import GraphPass

__all__ = ["ColumnSumsAsProducts"]

# NOTE [Column sums as products]
# A linear layer's bias gradient is the sum of its output gradient over the
# tokens: aten.sum(g, [0]) on a 2-D g. Inductor's C++ backend compiles that
# reduction over the outer dimension slowly: on one core (torch 2.11) a
# 1024 x 1024 float32 g takes 2.2-2.4 ms in its kernel against 0.6-0.9 ms
# for aten.sum and 0.45-0.66 ms for ones(1, 1024) @ g, a product inductor
# leaves to MKL as an extern call, which runs at memory speed. In a fused
# backward inductor hides part of the cost in the kernel that makes g; a
# split backward's dw graph reads g cold and pays all of it: on the graph
# stage of bench/python/bench_graph_stage.py (d 256) the dw graph's sum
# kernels took 5.5 ms of the 105 ms split backward, and with the rewrite dw
# took 46 ms against 51 (docs/benchmarks.md).
# This pass rewrites each such sum of a CPU float32/float64 tensor with at
# least `min_rows` rows (default 32: below that a fused reduction costs less
# than a call) as ones(1, rows) @ g, viewed as [cols] unless keepdim, before
# the backend compiles the graph. The result is the same sum in another
# order: equal to rounding, not bit for bit. Other devices keep their
# reductions: a GPU's are not the C++ code measured here.


class ColumnSumsAsProducts(GraphPass):
    """Rewrites sum(g, [0]) of a 2-D CPU float tensor as ones(1, rows) @ g
    (NOTE [Column sums as products])."""

    name = "column_sums_as_products"

    def __init__(self, min_rows: int = 32):
        self.min_rows = int(min_rows)

    def run(self, gm, **context):
        import torch
        import torch.fx as fx

        aten = torch.ops.aten
        count = 0
        for n in list(gm.graph.nodes):
            if not (n.op == "call_function" and n.target is aten.sum.dim_IntList):
                continue
            src = n.args[0]
            if len(n.args) > 3 or n.kwargs.get("dtype") is not None or not isinstance(src, fx.Node):
                continue
            keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            val = src.meta.get("val")
            if (not isinstance(val, torch.Tensor) or val.dim() != 2
                    or list(n.args[1]) not in ([0], [-2]) or val.device.type != "cpu"
                    or val.dtype not in (torch.float32, torch.float64)
                    or val.shape[0] < self.min_rows):
                continue
            rows, cols = val.shape
            with gm.graph.inserting_before(n):
                ones = gm.graph.call_function(aten.ones.default, ([1, rows],),
                                              {"dtype": val.dtype, "device": val.device})
                out = gm.graph.call_function(aten.mm.default, (ones, src))
                if not keepdim:
                    out = gm.graph.call_function(aten.view.default, (out, [cols]))
            if "val" in n.meta:
                out.meta["val"] = n.meta["val"]
            n.replace_all_uses_with(out)
            gm.graph.erase_node(n)
            count += 1
        if count:
            gm.graph.lint()
            gm.recompile()
        return gm
