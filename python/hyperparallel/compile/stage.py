"""Graph-mode pipeline stages: a module run as captured FX graphs whose
backward comes in two halves, dx and dw (NOTE [Graph stages]).

`GraphStage(module, backend=None)` captures, per input signature, the joint
forward + backward graph of `module` with make_fx and partitions it into

    forward:  (state, inputs)        -> (outputs, saved)
    dx:       (saved, output grads)  -> (input grads, residuals it computed)
    dw:       (residuals)            -> parameter grads  (dx's and saved ones)
    backward: (saved, output grads)  -> (parameter grads, input grads)   # fused

each replayed as it is or compiled by a torch.compile backend ("inductor").
Under a pipeline schedule with I and W, I runs dx and W runs dw: a compiled
stage gets a real zero-bubble schedule, each graph once per microbatch.
"""

from __future__ import annotations

import functools
import operator
import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.graph import get_gradient_edge
from torch.fx.experimental.proxy_tensor import make_fx

from ..losses import add_loss, collect_losses
from .passes.column_sums import ColumnSumsAsProducts
from .passes.pipeline import PassPipeline
from .tracer import _distinct, _train_mode_kept, check_leaf_types, run_reparametrized

__all__ = ["GraphStage", "split_joint_graph", "SplitGraphs"]

# NOTE [Graph stages]
# A pipeline's split schedules need a stage's backward in two halves: I (the
# input gradient, on the critical path) and W (the weight gradient, free to
# move). Eager stages get them from LibTorch's engine (hp/autograd, NOTE [The
# dx/dw split]). A torch.compile'd region cannot: its backward is one autograd
# node that computes both, so it runs whole in I and again in W (NOTE
# [Compiled stages under a split schedule] in pipeline/checks.py). A GraphStage
# splits at the graph level instead, as torchtitan's graph_trainer
# `split_di_dw` does:
#   1. Capture. make_fx traces `autograd.grad(outputs, params + inputs,
#      output_grads)` after the forward into one joint graph (as
#      trace_model_graph does for a whole train step); a first, forward-only
#      trace learns the output structure and which outputs are
#      differentiable, so the output grads can be placeholders.
#   2. Partition. The forward graph is every ancestor of the outputs (and the
#      getitems of its multi-output ops); what the backward reads of it is
#      "saved". In the backward, dx is every ancestor of the input grads and
#      dw the rest of the parameter grads' ancestors; what dw reads of dx's
#      values, of the saved ones or of the output grads are its "residuals",
#      which dx returns beside the input grads.
#   3. Run. One autograd.Function holds the stage's node. Its backward asks
#      the engine whether the current call will run the parameters' gradient
#      nodes (torch._C._will_engine_execute_node): no (the pipeline's I, an
#      autograd.grad for the inputs) -> dx, residuals kept on the node; yes
#      after a dx -> dw from the residuals (the pipeline's W re-enters the
#      node with its input edge masked); yes without one -> the fused
#      backward. So the same module is exact under `loss.backward()`, under
#      any schedule and under hyperparallel.split, with no hook in the
#      executor. After dx only the residuals stay: the rest of what the
#      forward saved is freed (the eager split's rule, NOTE [The dx/dw split]).
# Auxiliary losses the module adds (hyperparallel.pipeline.add_loss) are
# outputs of the graphs too, added again, as tensors of the stage's node, by
# the stage's forward: they join the backward through dx and dw as the
# outputs do.
# Each graph is replayed as it is, or compiled by the backend (one compile per
# graph per signature, NOTE [Graphs compiled without dynamo] in
# passes/pipeline.py); before a backend compiles them, the backward graphs'
# bias sums become products (NOTE [Column sums as products] in
# passes/column_sums.py). A new input signature (shapes, strides, dtypes,
# structure, which inputs need a gradient, training mode) captures and
# compiles anew.
# Under no_grad, or on fake tensors (the Pipeline's shape probe), the stage
# runs its module eagerly: nothing to split, nothing worth capturing.


class SplitGraphs:
    """The four graphs of one signature, and what ties them together."""

    def __init__(self, forward: fx.GraphModule, dx: fx.GraphModule, dw: fx.GraphModule,
                 backward: fx.GraphModule, num_outputs: int, num_param_grads: int,
                 num_input_grads: int, passed: Sequence[int] = ()):
        self.forward, self.dx, self.dw, self.backward = forward, dx, dw, backward
        self.num_outputs = num_outputs
        self.num_param_grads = num_param_grads
        self.num_input_grads = num_input_grads
        # dw's inputs: dx's outputs after the input grads, then these of dx's
        # inputs (positions in (saved..., output grads...)).
        self.passed = list(passed)

    def __repr__(self) -> str:
        def ops(gm):
            return sum(1 for n in gm.graph.nodes if n.op == "call_function")

        return (f"SplitGraphs(forward={ops(self.forward)} ops, dx={ops(self.dx)} ops, "
                f"dw={ops(self.dw)} ops, backward={ops(self.backward)} ops)")


_aten = torch.ops.aten
_VIEWS = (_aten.t.default, _aten.view.default, _aten.permute.default, _aten.transpose.int,
          _aten._unsafe_view.default, _aten.expand.default, _aten.reshape.default,
          _aten.unsqueeze.default, _aten.squeeze.dim, _aten.alias.default, _aten.detach.default)


def _ancestors(roots: Sequence[fx.Node], stop: Set[fx.Node] = frozenset()) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _subgraph(root: fx.GraphModule, inputs: Sequence[fx.Node], nodes: Set[fx.Node],
              outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """A GraphModule of `nodes` (in root's order) reading `inputs` as
    placeholders and returning `outputs` as a list."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in_{i}")
        env[n].meta = dict(n.meta)
    for n in root.graph.nodes:
        if n in nodes and n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output([env[o] for o in outputs])
    gm = fx.GraphModule(root, g)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def split_joint_graph(joint: fx.GraphModule, num_primals: int, num_outputs: int,
                      num_param_grads: int) -> SplitGraphs:
    """Partitions a joint graph (NOTE [Graph stages], step 2).

    joint: placeholders (primals..., output grads...), output [outputs...,
    parameter grads..., input grads...]; `num_primals` placeholders are the
    state and inputs, the rest the output grads."""
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals, tangents = placeholders[:num_primals], placeholders[num_primals:]
    out_node = next(n for n in joint.graph.nodes if n.op == "output")
    results = list(out_node.args[0])
    outputs = results[:num_outputs]
    param_grads = results[num_outputs:num_outputs + num_param_grads]
    input_grads = results[num_outputs + num_param_grads:]
    for r in results:
        if not isinstance(r, fx.Node):
            raise RuntimeError(f"graph stage: the joint graph returned a constant {r!r}")

    fwd = _ancestors(outputs)
    if fwd & set(tangents):
        raise RuntimeError("graph stage: a forward output depends on an output gradient")
    for n in list(fwd):  # the other outputs of a multi-output op stay with it
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem:
                fwd.add(u)
    fwd_inputs = set(primals)
    bwd = _ancestors(param_grads + input_grads, stop=fwd | set(placeholders))
    grad_results = set(param_grads + input_grads)
    saved = [n for n in joint.graph.nodes if (n in fwd or n in fwd_inputs)
             and (n in grad_results or any(u in bwd for u in n.users))]
    forward = _subgraph(joint, primals, fwd - fwd_inputs, outputs + saved)
    backward = _subgraph(joint, saved + tangents, bwd, param_grads + input_grads)

    dx_nodes = _ancestors(input_grads, stop=set(saved) | set(tangents))
    dw_nodes = _ancestors(param_grads, stop=set(saved) | set(tangents) | dx_nodes)
    # The other outputs of a multi-output op of dx (layer norm's backward
    # computes its weight's gradient too) are taken in dx: dx hands over
    # tensors, not tuples.
    for n in list(dw_nodes):
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in dx_nodes:
            dw_nodes.discard(n)
            dx_nodes.add(n)
    # A view dw reads (a weight's t(), a reshape) is taken again in dw from
    # its base: dx hands over bases, not views of them.
    changed = True
    while changed:
        changed = False
        for n in list(dx_nodes):
            if (n.op == "call_function" and n.target in _VIEWS and n not in dw_nodes
                    and any(u in dw_nodes for u in n.users)):
                dw_nodes.add(n)
                changed = True
    reachable = set(saved) | set(tangents) | dx_nodes
    residuals = [n for n in joint.graph.nodes
                 if n in reachable and n not in dw_nodes
                 and (any(u in dw_nodes for u in n.users) or n in param_grads)]
    # What dw reads of dx's own inputs goes to it directly, not through dx's
    # outputs: an output that is an input is an alias, which a compiled graph
    # pays for at every call.
    inputs_of_dx = saved + tangents
    computed = [n for n in residuals if n in dx_nodes]
    passed = [n for n in residuals if n not in dx_nodes]
    dx = _subgraph(joint, inputs_of_dx, dx_nodes, input_grads + computed)
    dw = _subgraph(joint, computed + passed, dw_nodes, param_grads)
    return SplitGraphs(forward, dx, dw, backward, num_outputs, len(param_grads),
                       len(input_grads), [inputs_of_dx.index(n) for n in passed])


def _will_run(node) -> bool:
    """Whether the running backward will execute `node` (NOTE [Graph stages])."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        # A leaf's node asked for by autograd.grad (captured, not
        # accumulated): the call wants that gradient.
        return True


class _Signature:
    """One captured signature: its graphs (compiled or not) and their layout."""

    def __init__(self, graphs: SplitGraphs, run: Dict[str, Any], state_grad: List[int],
                 input_grad: List[int], out_spec, out_leaves: List[Any], out_diff: List[int],
                 out_meta: List[Tuple[torch.Size, torch.dtype, torch.device]],
                 num_aux: int = 0):
        self.graphs = graphs
        self.run = run  # name -> callable
        self.state_grad = state_grad    # positions in the state of the params with a grad
        self.input_grad = input_grad    # positions in the tensor inputs that get a grad
        self.out_spec = out_spec
        self.out_leaves = out_leaves    # non-tensor output leaves (tensors: None)
        self.out_diff = out_diff        # indices of the differentiable tensor outputs
        self.out_meta = out_meta        # per differentiable output: shape, dtype, device
        self.num_aux = num_aux          # auxiliary losses, the last tensor outputs


class _StageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stage: "GraphStage", sig: _Signature, num_state: int, *flat):
        g = sig.graphs
        results = sig.run["forward"](*flat)
        stage.counts["forward"] += 1
        outs, saved = list(results[:g.num_outputs]), list(results[g.num_outputs:])
        ctx.stage, ctx.sig = stage, sig
        # Saved outputs go through save_for_backward (a plain attribute would
        # make a cycle: output -> this node -> output); the rest stay
        # plain so that dx can free them.
        out_ids = {id(o): i for i, o in enumerate(outs)}
        ctx.saved_kinds = [("out", out_ids[id(s)]) if id(s) in out_ids else ("own", s)
                           for s in saved]
        ctx.save_for_backward(*[outs[i] for i in sorted({k[1] for k in ctx.saved_kinds
                                                         if k[0] == "out"})])
        ctx.saved_out_index = sorted({k[1] for k in ctx.saved_kinds if k[0] == "out"})
        ctx.param_nodes = [get_gradient_edge(flat[i]).node for i in sig.state_grad]
        ctx.num_state = num_state
        ctx.num_flat = len(flat)
        ctx.residuals = None
        ctx.done = False
        non_diff = [o for i, o in enumerate(outs) if i not in set(sig.out_diff)]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        sig, stage = ctx.sig, ctx.stage
        g = sig.graphs
        result: List[Optional[torch.Tensor]] = [None] * (3 + ctx.num_flat)

        def place(param_grads, input_grads):
            for pos, t in zip(sig.state_grad, param_grads):
                result[3 + pos] = t
            for pos, t in zip(sig.input_grad, input_grads):
                result[3 + ctx.num_state + pos] = t

        want_w = any(_will_run(n) for n in ctx.param_nodes)
        if ctx.residuals is not None:
            if want_w:  # W after I: the weight half
                residuals, ctx.residuals = ctx.residuals, None
                place(sig.run["dw"](*residuals), [])
                stage.counts["dw"] += 1
                ctx.done = True
            return tuple(result)
        if ctx.done:
            raise RuntimeError(
                "GraphStage: this forward's backward ran in two halves already (dx freed "
                "what dw did not need); run the forward again")
        kept = {i: t for i, t in zip(ctx.saved_out_index, ctx.saved_tensors)}
        saved = [kept[k[1]] if k[0] == "out" else k[1] for k in ctx.saved_kinds]
        tangents = []
        for j, (i, (shape, dtype, device)) in enumerate(zip(sig.out_diff, sig.out_meta)):
            t = grads[i]
            tangents.append(torch.zeros(shape, dtype=dtype, device=device) if t is None
                            else t.contiguous())
        if want_w or not sig.input_grad:  # fused: B, or a W with no I before it
            out = sig.run["backward"](*saved, *tangents)
            place(out[:g.num_param_grads], out[g.num_param_grads:])
            stage.counts["backward"] += 1
            return tuple(result)  # saved values live on with the node (retain_graph)
        else:  # I: the input half; the residuals wait for W
            args = [*saved, *tangents]
            out = sig.run["dx"](*args)
            place([], out[:g.num_input_grads])
            stage.counts["dx"] += 1
            if sig.state_grad:
                ctx.residuals = list(out[g.num_input_grads:]) + [args[i] for i in g.passed]
            else:
                ctx.done = True
            ctx.saved_kinds = []  # what dx alone needed is freed here
        return tuple(result)


class GraphStage(torch.nn.Module):
    """`module`, run as captured FX graphs whose backward is split into dx and
    dw (NOTE [Graph stages]).

    backend: None (replay the FX graphs) or a torch.compile backend
        ("inductor", "aot_eager", a callable) that compiles each graph.
    tracing_mode: make_fx's ("fake" by default; "real" for forwards fake
        tensors cannot run).

    Parameter names are the module's (no prefix): the stage holds the module
    as its only child under the name ``module`` but reports its parameters
    through it unchanged when given to a Pipeline or an optimizer. Graphs
    are cached per input signature; ``counts`` says how often each graph ran.
    """

    def __init__(self, module: torch.nn.Module, backend: Any = None, tracing_mode: str = "fake"):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"GraphStage: module must be a torch.nn.Module, not "
                            f"{type(module).__name__}")
        if isinstance(module, GraphStage):
            raise TypeError("GraphStage: the module is a GraphStage already")
        if tracing_mode not in ("fake", "real", "symbolic"):
            raise ValueError(f"GraphStage: tracing_mode is {tracing_mode!r}; give 'fake', "
                             "'real' or 'symbolic'")
        if backend is not None and not (isinstance(backend, str) or callable(backend)):
            raise ValueError(f"GraphStage: backend is {backend!r}; give None, a torch.compile "
                             "backend name (e.g. 'inductor') or a callable")
        _check_plain(module)
        self.module = module
        self.backend = backend
        self.tracing_mode = tracing_mode
        self.counts: Dict[str, int] = {"capture": 0, "forward": 0, "dx": 0, "dw": 0,
                                       "backward": 0}
        self._signatures: Dict[Any, _Signature] = {}
        self._lock = threading.Lock()
        # The Pipeline hands a stage the keyword arguments its forward takes:
        # say the module's (NOTE [Keyword arguments of every stage]).
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            return GraphStage._run(self, args, kwargs)

        self.forward = forward

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    def graphs(self) -> List[SplitGraphs]:
        """The captured graphs, one entry per signature seen."""
        return [s.graphs for s in self._signatures.values()]

    # -- running ----------------------------------------------------------

    def _run(self, args: tuple, kwargs: dict):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not torch.is_grad_enabled() or any(_is_fake(t) for t in tensors):
            return self.module(*args, **kwargs)
        check_leaf_types((args, kwargs), "(args, kwargs)")
        p_fqns, p_tensors, _ = _distinct(self.module.named_parameters(remove_duplicate=False))
        b_fqns, b_tensors, _ = _distinct(self.module.named_buffers(remove_duplicate=False))
        state = p_tensors + b_tensors
        key = (str(spec), self.module.training,
               tuple(("T", tuple(x.shape), x.stride(), x.dtype, str(x.device), _needs_grad(x))
                     if isinstance(x, torch.Tensor) else (type(x).__name__, x) for x in leaves),
               tuple((tuple(t.shape), t.stride(), t.dtype, str(t.device), t.requires_grad)
                     for t in state))
        with self._lock:
            sig = self._signatures.get(key)
            if sig is None:
                sig = self._capture(args, kwargs, leaves, spec, p_fqns, b_fqns, state)
                self._signatures[key] = sig
        outs = _StageFunction.apply(self, sig, len(state), *state, *tensors)
        if sig.num_aux:  # handed on as the module handed them (NOTE [Auxiliary losses])
            for a in outs[len(outs) - sig.num_aux:]:
                add_loss(a)
        full, k = [], 0
        for leaf in sig.out_leaves:
            if leaf is _TENSOR:
                full.append(outs[k])
                k += 1
            else:
                full.append(leaf)
        return pytree.tree_unflatten(full, sig.out_spec)

    def _capture(self, args, kwargs, leaves, spec, p_fqns, b_fqns, state) -> _Signature:
        module = self.module
        _check_plain(module)  # e.g. fully_shard after the stage was made
        fqns = p_fqns + b_fqns
        _, _, aliases_p = _distinct(module.named_parameters(remove_duplicate=False))
        _, _, aliases_b = _distinct(module.named_buffers(remove_duplicate=False))
        aliases = {**aliases_p, **aliases_b}
        tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        inputs = [leaves[i] for i in tensor_pos]
        state_grad = [i for i, t in enumerate(state[:len(p_fqns)]) if t.requires_grad]
        input_grad = [j for j, x in enumerate(inputs) if _needs_grad(x)]
        n_state, n_in = len(state), len(inputs)

        def call(flat_state, flat_inputs):
            """The module's output, and the auxiliary losses it added (NOTE
            [Auxiliary losses] in losses.py): extra outputs of the graph."""
            with collect_losses() as aux:
                out = run_reparametrized(module, fqns, aliases, flat_state, leaves, tensor_pos,
                                         flat_inputs, spec,
                                         lambda akw: module(*akw[0], **akw[1]))
            return out, aux

        def samples():
            s = [t.detach().requires_grad_(i in state_grad) for i, t in enumerate(state)]
            x = [t.detach().requires_grad_(j in input_grad) for j, t in enumerate(inputs)]
            return s, x

        # First trace: the output's structure and which outputs need a grad.
        found: Dict[str, Any] = {}

        def forward_only(*flat):
            out, aux = call(flat[:n_state], flat[n_state:])
            out_leaves, out_spec = pytree.tree_flatten(out)
            found["spec"] = out_spec
            found["leaves"] = [_TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves]
            found["aux"] = len(aux)
            tensors_out = [o for o in out_leaves if isinstance(o, torch.Tensor)] + aux
            found["diff"] = [i for i, o in enumerate(tensors_out) if o.requires_grad]
            found["meta"] = [(o.shape, o.dtype, o.device) for o in tensors_out]
            return tensors_out

        s, x = samples()
        try:
            with torch.autograd.set_multithreading_enabled(False), _train_mode_kept(module):
                make_fx(forward_only, tracing_mode=self.tracing_mode,
                        _allow_non_fake_inputs=True)(*s, *x)
        except Exception as e:
            raise RuntimeError(
                f"GraphStage: capturing {type(module).__name__}'s forward failed ({e}); "
                "a graph stage needs a forward make_fx can trace (no data-dependent "
                "control flow; tracing_mode='real' runs forwards fake tensors cannot)") from e
        for leaf in found["leaves"]:
            if leaf is not _TENSOR and not isinstance(leaf, (int, float, bool, str, type(None))):
                raise TypeError(f"GraphStage: {type(module).__name__}'s forward returned a "
                                f"{type(leaf).__name__} leaf; outputs must be tensors or "
                                "int, float, bool, str, None")
        diff = found["diff"]
        if not diff:
            raise ValueError(f"GraphStage: no output of {type(module).__name__} needs a "
                             "gradient; nothing to train through a graph stage")
        meta = [found["meta"][i] for i in diff]

        def joint(*flat):
            st, ins = flat[:n_state], flat[n_state:n_state + n_in]
            tangents = flat[n_state + n_in:]
            out, aux = call(st, ins)
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)] + aux
            wrt = [st[i] for i in state_grad] + [ins[j] for j in input_grad]
            grads = torch.autograd.grad([outs[i] for i in diff], wrt, tangents,
                                        allow_unused=True)
            grads = [torch.zeros_like(w) if gr is None else gr for w, gr in zip(wrt, grads)]
            return [*outs, *grads]

        s, x = samples()
        tangents = [torch.empty(shape, dtype=dtype, device=device)
                    for shape, dtype, device in meta]
        with torch.autograd.set_multithreading_enabled(False), _train_mode_kept(module):
            gm = make_fx(joint, tracing_mode=self.tracing_mode,
                         _allow_non_fake_inputs=True)(*s, *x, *tangents)
        graphs = split_joint_graph(gm, n_state + n_in, len(found["meta"]), len(state_grad))
        # With a backend, the backward graphs' bias sums become products first
        # (NOTE [Column sums as products]).
        compiler = PassPipeline([ColumnSumsAsProducts()] if self.backend is not None else (),
                                backend=self.backend)
        for name in ("dx", "dw", "backward"):
            compiler.run(getattr(graphs, name))
        run = {name: compiler.compile(getattr(graphs, name))
               for name in ("forward", "dx", "dw", "backward")}
        self.counts["capture"] += 1
        return _Signature(graphs, run, state_grad, input_grad, found["spec"],
                          found["leaves"], diff, meta, found["aux"])


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()


def _check_plain(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        if type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor:
            raise TypeError(
                f"GraphStage: parameter {name!r} is a {type(p).__name__}; a graph stage "
                "takes plain tensors (no DTensor, FSDP2 or other tensor subclass)")


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
