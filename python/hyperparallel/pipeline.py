"""Train your own ``nn.Module`` stages with any hyperparallel schedule.

The stages run on hyperparallel's C++ executor over the
``torch.distributed`` process group you made (Gloo on CPU, NCCL on GPU),
started the usual way (``torchrun``). Each rank builds the model chunks its
stages compute (``chunks_of_rank``), gives them to :class:`Pipeline`, and
calls :meth:`Pipeline.step` once per optimizer step; weight gradients land in
the parameters' ``.grad`` as ``loss.backward()`` would put them, so any
optimizer steps them.

    import torch.distributed as dist
    import hyperparallel as hp

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    sched = hp.pipeline.schedule("zbv", ranks=p, microbatches=8)
    chunks = {c: make_chunk(c, sched.num_chunks) for c in sched.chunks_of_rank(rank)}
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=torch.nn.functional.cross_entropy,
                                activation_shape=(4, 64, 128))
    opt = torch.optim.AdamW([q for c in chunks.values() for q in c.parameters()])
    for inputs, targets in data:
        opt.zero_grad()
        loss = pipe.step(inputs, targets)
        opt.step()
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import math
import pickle
import threading
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C
from .split_model import _SharedGradients, moe_aux_losses, split_model  # cutting one model into chunks

__all__ = ["PipelineSchedule", "schedule", "Pipeline", "add_loss", "collect_losses",
           "cpu_cache_bytes", "empty_cpu_cache",
           "split_model", "moe_aux_losses"]


#: The schedule a :class:`Pipeline` runs: hyperparallel's one ``Schedule``
#: type (``hyperparallel.schedule.Schedule``, the C++ ``hp::schedule::Schedule``
#: bound), with ``chunks_of_rank``, ``needs_inputs``, ``needs_targets`` and
#: ``has_split`` for the runtime's callers. No copy, no text between them.
PipelineSchedule = _C.schedule.Schedule


# NOTE [Auxiliary losses]
# A stage may add scalar losses of its own beside its output (a MoE router's
# load-balancing loss): `add_loss(t)` inside its forward. The Pipeline runs
# each chunk's forward through _StageForward, which collects them for that
# (stage, microbatch) and ties their sum to the output with _WithAuxiliary:
# the output unchanged forward; backward, the output's gradient passes
# through and the sum gets the step's loss scale (1/m, the weight of one
# microbatch's loss, NOTE [The loss scale is the backward's seed] in
# hp/pipeline/stage.cpp) as its gradient. So the auxiliary term joins the
# backward of the stage that made it, wherever the schedule runs it and
# however it splits it (B, or I then W: the node is on the path from the
# output to the input and the weights alike), and the gradients are those
# of loss + sum(aux) averaged over the microbatches, as one process computes
# them. Each rank sums its auxiliary values (detached) over the step; the
# runtime reduces that sum in the same collective as the loss
# (PipelineOptions::extra_sum) and `last_stats["aux_loss"]` reports it as
# the mean over microbatches. Outside a Pipeline, `collect_losses()` gathers
# them for a single-process run of the same model code.
_collecting = threading.local()


def add_loss(loss: torch.Tensor) -> None:
    """Adds a scalar auxiliary loss (e.g. a MoE load-balancing loss) from
    inside a stage's forward: it joins that stage's backward with the step's
    loss scale and is reported per step as ``pipe.last_stats["aux_loss"]``
    (NOTE [Auxiliary losses]). Outside a Pipeline's forward, inside
    ``with collect_losses() as aux:`` it is appended to ``aux``; elsewhere it
    is an error."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"add_loss: an auxiliary loss must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"add_loss: an auxiliary loss must be a scalar (one element), got shape "
            f"{tuple(loss.shape)}"
        )
    sink = getattr(_collecting, "sink", None)
    if sink is None:
        raise RuntimeError(
            "add_loss was called outside a Pipeline stage's forward and outside "
            "hyperparallel.pipeline.collect_losses(): nothing would train on it"
        )
    sink.append(loss.reshape(()))


class collect_losses:
    """``with collect_losses() as aux: out = model(x)``: the auxiliary losses
    that ``add_loss`` adds inside, in a list (a single-process run of the
    model code a Pipeline trains)."""

    def __enter__(self) -> List[torch.Tensor]:
        self._outer = getattr(_collecting, "sink", None)
        self.losses: List[torch.Tensor] = []
        _collecting.sink = self.losses
        return self.losses

    def __exit__(self, *exc) -> None:
        _collecting.sink = self._outer


class _WithAuxiliary(torch.autograd.Function):
    """The output unchanged; backward, the auxiliary sum's gradient is the
    loss scale (NOTE [Auxiliary losses])."""

    @staticmethod
    def forward(ctx, output, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        dtype, device = ctx.aux_meta
        return grad_output, torch.full((), ctx.scale, dtype=dtype, device=device), None


class _AuxiliarySum:
    """One rank's auxiliary losses of the running step (detached)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.total: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor) -> None:
        t = t.detach().to(torch.float64)
        self.total = t if self.total is None else self.total + t

    def take(self) -> float:
        """The step's sum times the scale (its mean over microbatches), reset."""
        total, self.total = self.total, None
        return 0.0 if total is None else total.item() * self.scale


# NOTE [Keyword arguments of every stage]
# Real model code gives its blocks more than the hidden states: position ids,
# an attention mask. `step(inputs, targets, **kwargs)` takes them once for
# the step: a tensor is split into the microbatches along dim 0 (as inputs
# are; a batch that does not divide is a ValueError naming it), anything
# else is a constant. Every rank is given them (its script is the same), so
# they never travel between ranks: each stage's forward gets, beside its
# activation, the ones it accepts (by its signature: all of them where it
# takes **kwargs), for the microbatch it runs (the runtime passes the
# microbatch with each F). So they carry no gradient back; a kwarg that
# requires grad is refused.
class _StepKwargs:
    """The keyword arguments of the running step, per microbatch (NOTE
    [Keyword arguments of every stage])."""

    def __init__(self):
        self.per_microbatch: List[Dict[str, object]] = []
        self.constant: Dict[str, object] = {}

    def of(self, mb: int, accepts) -> Dict[str, object]:
        if not self.per_microbatch and not self.constant:
            return {}
        kw = dict(self.constant)
        if self.per_microbatch:
            kw.update(self.per_microbatch[mb])
        if accepts is None:
            return kw
        return {k: v for k, v in kw.items() if k in accepts}


def _accepted_kwargs(fn) -> Optional[frozenset]:
    """The keyword arguments `fn` (a module's forward, or a callable) takes
    beside its first argument: None for all of them (``**kwargs``)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return frozenset()
    names, positional = set(), 0
    for prm in sig.parameters.values():
        if prm.kind is prm.VAR_KEYWORD:
            return None
        if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD) and positional == 0:
            positional += 1  # the activation
            continue
        if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY):
            names.add(prm.name)
    return frozenset(names)


# NOTE [Arguments of a step]
# Every rank calls step() with its own arguments, and a rank's checks of
# them (a batch that does not divide, targets missing, a keyword argument no
# stage takes) used to fail on that rank alone: its peers, already in the
# step, waited for it until the process exited (a notebook's never does) or
# Gloo's own 30 minutes. And keyword arguments were never compared: a mask
# given to one rank only trained another model without a word. Now:
#  - A key that no chunk of the pipeline takes, on any rank (the ranks
#    exchange their chunks' keyword arguments when the Pipeline is made), is
#    an error on the rank given it, before any communication: a misspelt
#    attn_mask= for attention_mask= is no longer dropped.
#  - The ranks agree on the step's keyword arguments: a fingerprint of their
#    keys, tensors' shapes and dtypes and constants' values (plain numbers,
#    strings and tuples of them; other objects by type) goes through one
#    all-reduce (MAX) of every rank's fingerprint and error flag; ranks that
#    differ are one ValueError on every rank, naming each rank's arguments,
#    before any rank runs the step. Tensors' values are not compared (nor
#    are the inputs'). With shapes found (no activation_shape) the step has
#    that all-reduce anyway (NOTE [Shapes found, not declared]), and the
#    flags ride in it: every step is checked for free. With a declared shape
#    the agreement runs on the first step and on a step whose fingerprint
#    differs from this rank's previous one, so a steady loop pays nothing;
#    the cost is that a change on one rank alone, after the first step, waits
#    in the agreement until the timeout (its peers are in the step).
#  - A rank whose own checks fail while its peers take part in the agreement
#    sends its error flag there: every rank raises (the failed rank its
#    error, the others naming it) and the Pipeline stays usable. Otherwise
#    (a declared shape, nothing changed) its peers may already wait in the
#    step: it tells them through the runtime's abandon (the rings and store
#    of NOTE [A failed step reaches the peers] in hp/distributed/comm.h), so
#    they fail within a fraction of a second naming it, and the Pipeline is
#    done on every rank, as after a failed step.
#  - Every collective of the Python side (the agreement, the shape probes,
#    the shared parameters' sums, FSDP2's loss) waits at most the Pipeline's
#    timeout.
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _kwargs_signature(kwargs) -> tuple:
    """What the ranks compare of a step's keyword arguments (NOTE [Arguments
    of a step]): per key, a tensor's shape and dtype, a plain value's repr
    (tuples and lists of them too), another object's type."""

    def plain(v) -> bool:
        return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and len(v) <= 64
                                         and all(isinstance(x, _PLAIN) for x in v))

    out = []
    for key in sorted(kwargs):
        v = kwargs[key]
        if isinstance(v, torch.Tensor):
            out.append((key, "tensor", tuple(v.shape), str(v.dtype).replace("torch.", "")))
        elif plain(v):
            text = repr(v)
            out.append((key, type(v).__name__, text if len(text) <= 100 else
                        text[:100] + f"... ({len(text)} characters)"))
        else:
            out.append((key, type(v).__name__))
    return tuple(out)


def _describe_kwargs(signature) -> str:
    if not signature:
        return "no keyword arguments"
    parts = []
    for item in signature:
        if item[1] == "tensor":
            parts.append(f"{item[0]}=tensor{list(item[2])} {item[3]}")
        elif len(item) == 3:
            parts.append(f"{item[0]}={item[2]}")
        else:
            parts.append(f"{item[0]}=<{item[1]}>")
    return ", ".join(parts)


class _StageForward:
    """A chunk's forward as the runtime calls it, ``(x, microbatch)``: hands
    the module the step's keyword arguments it accepts (NOTE [Keyword
    arguments of every stage]), collects the auxiliary losses it adds and
    ties them to its output (NOTE [Auxiliary losses])."""

    def __init__(self, fn: Callable, aux: _AuxiliarySum, kwargs: _StepKwargs, accepts):
        self.fn = fn
        self.aux = aux
        self.kwargs = kwargs
        self.accepts = accepts
        self.finder: Optional["_ShapeFinder"] = None  # pytrees between stages, when found
        self.dtype = torch.float32
        self.schedule = None
        self.last_outputs: Dict[int, object] = {}  # mb -> a last stage's structure

    def probe(self, x: torch.Tensor, mb: int, kwargs: Dict[str, object]) -> torch.Tensor:
        """The module's output for `x` with the given keyword arguments (those
        it accepts), nothing collected: the shape finder's call."""
        if self.accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return self.fn(x, **kwargs)

    def __call__(self, x: torch.Tensor, mb: int, stage: int) -> torch.Tensor:
        packing = None
        if self.finder is not None:  # NOTE [Pytrees between stages]
            given = self.finder.input_packing(stage, mb)
            if given is not None:
                x = given.unpack(x)
            packing = self.finder.packing(stage, mb)
        outer = getattr(_collecting, "sink", None)
        added: List[torch.Tensor] = []
        _collecting.sink = added
        try:
            out = self.fn(x, **self.kwargs.of(mb, self.accepts))
        finally:
            _collecting.sink = outer
        if not isinstance(out, (torch.Tensor, tuple, list, dict)):
            raise TypeError(
                f"stage {stage} microbatch {mb}: a stage's forward must return a torch.Tensor "
                f"or a tuple, list or dict of them, got {type(out).__name__}")
        if packing is not None:
            out = packing.pack(out, self.dtype, stage, mb)
        elif not isinstance(out, torch.Tensor) and self.schedule.next_stage(stage, mb) < 0:
            # A last stage's structure goes to the loss function as it is.
            self.last_outputs[mb] = out
            out = torch.zeros(0)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {stage} microbatch {mb}: the forward returned a "
                f"{type(out).__name__}; a structure of tensors between stages needs the "
                "shapes found (Pipeline without activation_shape)")
        if not added:
            return out
        total = added[0]
        for t in added[1:]:  # the dtypes may differ (a router's float32 term)
            total = total + t
        for t in added:  # reported in float64, each as it was added
            self.aux.add(t)
        if not total.requires_grad or not isinstance(out, torch.Tensor):
            return out
        return _WithAuxiliary.apply(out, total, self.aux.scale)


# NOTE [Shapes found, not declared]
# Without `activation_shape` the Pipeline learns what each stage hands the
# next, and learns it again whenever a step's inputs have other shapes
# (sequence lengths that change from step to step), without being rebuilt.
# At the start of each step the ranks agree on the step's input shapes and
# dtypes, one microbatch per row, in one all-reduce (MAX) over the pipeline's
# group: only the ranks that run a route's first stage know the inputs, the
# others contribute -1; the keyword arguments every rank has. A signature
# seen before reuses its shapes: that all-reduce of m x 10 integers is all a
# step of unchanged shapes costs beyond a declared one. A new signature is
# probed, for each distinct microbatch signature once: along the
# microbatch's route, the rank holding each stage runs its forward on fake
# tensors (torch's FakeTensorMode: shapes only, no compute, no memory; the
# stage's own parameters, its keyword arguments as fakes) and broadcasts the
# output's shape to every rank; the next stage's probe starts from it. A
# stage that fake tensors cannot run (a forward that reads values, or
# communicates, as FSDP2's hooks do) runs once for real on zeros, without
# autograd. The shapes then serve the runtime's receives (activation_shape
# as fn(stage, microbatch)). Probing costs one broadcast per stage and
# distinct microbatch signature, on the steps whose signature is new.
_MAX_DIMS = 8


# NOTE [Pytrees between stages]
# With shapes found, a stage may return a tuple, list or dict of tensors,
# nested, with leaves that are no tensors (ints, None, strings): the probe
# records its structure (a TreeSpec), each tensor leaf's shape, dtype and
# whether it takes a gradient, and the other leaves' values (the same for
# every microbatch of the signature). The runtime moves one tensor per
# transfer, so the sender packs the tensor leaves into one flat tensor of the
# pipeline's dtype (torch.cat: autograd splits the flat gradient back into
# each leaf's), those that take a gradient first, and the receiving stage's
# forward gets the structure back (split and viewed) as its first argument.
# A leaf that takes a gradient is cast to the pipeline's dtype and back; one
# that takes none (a mask, ids, a table, any dtype: int64, bool, bfloat16,
# complex) travels as its bytes, viewed as elements of the pipeline's dtype
# (padded to whole elements), so it arrives bit for bit (an int64 of 2^40 +
# 1 stays itself, where a cast to float32 rounded it above 2^24); nothing on
# the way computes on those bytes (Gloo, the shared-memory rings and host
# staging copy them). A complex leaf that takes a gradient is refused; a consecutive stage on the same rank, handed the flat tensor
# locally, unpacks it the same way. A leaf takes a gradient when the probe's
# forward (on fake tensors, with autograd on) made it require grad: masks,
# ids and rotary tables do not, and the receiver detaches them. Only the
# differentiable leaves' part of the flat gradient travels back (the
# runtime's gradient_numel: NOTE [Gradients shorter than their activations]
# in hp/pipeline/executor.cpp); a leaf the next stage does not use gets
# zeros. A stage that only runs for real in the probe (no autograd there)
# counts its floating-point leaves as differentiable. An output whose
# structure, shapes or other leaves differ from what the probe found for
# that microbatch, or a leaf that requires grad where the probe found none,
# is a ValueError naming the stage and microbatch.
class _Packing:
    """The structure of one stage's output (NOTE [Pytrees between stages])."""

    def __init__(self, spec_text: str, leaves: list, itemsize: int):
        import torch.utils._pytree as pytree

        self.spec_text = spec_text
        self.spec = pytree.treespec_loads(spec_text)
        # ("t", shape, dtype name, takes a gradient) or ("v", value)
        self.leaves = leaves
        self.itemsize = itemsize  # of the pipeline's dtype
        tensors = [i for i, m in enumerate(leaves) if m[0] == "t"]
        # The flat tensor's order: differentiable leaves first.
        self.order = [i for i in tensors if leaves[i][3]] + [i for i in tensors if not leaves[i][3]]
        self.sizes = [math.prod(leaves[i][1]) if leaves[i][3] else -(-self._bytes(i) // itemsize)
                      for i in self.order]
        self.numel = sum(self.sizes)
        self.grad_numel = sum(math.prod(leaves[i][1]) for i in tensors if leaves[i][3])

    def _bytes(self, i: int) -> int:
        _, shape, dtype_name, _ = self.leaves[i]
        return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()

    @staticmethod
    def _describe(leaves) -> list:
        return [("t", tuple(x.shape), str(x.dtype).replace("torch.", ""))
                if isinstance(x, torch.Tensor) else ("v", x) for x in leaves]

    @staticmethod
    def of(out, autograd: bool, dtype: torch.dtype) -> "_Packing":
        """`out`'s structure, to travel in `dtype`; a tensor leaf takes a
        gradient if it requires grad (`autograd`: the forward ran with it)
        or is of a floating dtype."""
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten(out)
        meta = [m + ((x.requires_grad if autograd else x.is_floating_point()),) if m[0] == "t"
                else m for m, x in zip(_Packing._describe(leaves), leaves)]
        for i, (m, x) in enumerate(zip(meta, leaves)):
            if m[0] == "t" and m[3] and x.is_complex():
                raise ValueError(
                    f"output leaf {i} ({m[1]}, {m[2]}) is complex and takes a gradient: between "
                    "stages a gradient travels in the pipeline's real dtype, which would drop its "
                    "imaginary part; hand on its real and imaginary parts (torch.view_as_real)")
        return _Packing(pytree.treespec_dumps(spec), meta,
                        torch.empty((), dtype=dtype).element_size())

    def fake(self, mode, device):
        """The structure with fake tensors (the next stage's probe input),
        the differentiable leaves requiring grad as they will for real."""
        import torch.utils._pytree as pytree

        leaves = []
        for m in self.leaves:
            if m[0] != "t":
                leaves.append(m[1])
                continue
            t = mode.from_tensor(torch.empty(m[1], dtype=getattr(torch, m[2]), device=device))
            leaves.append(t.requires_grad_(True) if m[3] else t)
        return pytree.tree_unflatten(leaves, self.spec)

    def pack(self, out, dtype: torch.dtype, stage: int, mb: int) -> torch.Tensor:
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten(out)
        got = self._describe(leaves)
        if got != [m[:3] for m in self.leaves] or pytree.treespec_dumps(spec) != self.spec_text:
            raise ValueError(
                f"stage {stage} microbatch {mb}: the output's structure differs from what this "
                f"step's first look found for it: {got!r} where "
                f"{[m[:3] for m in self.leaves]!r} was found "
                "(outputs of one microbatch signature must have one structure)")
        for i in self.order:
            if not self.leaves[i][3] and leaves[i].requires_grad:
                raise ValueError(
                    f"stage {stage} microbatch {mb}: output leaf {i} ({got[i][1]}, "
                    f"{got[i][2]}) requires grad, but this step's first look at the stage found "
                    "it does not (the probe runs the forward on fake tensors with autograd on): "
                    "its gradient would be lost; make it require grad (or not) the same way "
                    "whenever the forward runs")
        tensors, raw = [], []
        for i, n in zip(self.order, self.sizes):
            if self.leaves[i][3]:
                tensors.append(leaves[i].reshape(-1).to(dtype))
                continue
            b = leaves[i].detach().contiguous().reshape(-1).view(torch.uint8)
            raw.append(b)
            if n * self.itemsize > b.numel():  # padded to whole elements
                raw.append(b.new_zeros(n * self.itemsize - b.numel()))
        if raw:  # one fresh buffer: aligned for the view
            tensors.append(torch.cat(raw).view(dtype))
        return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)

    def unpack(self, flat: torch.Tensor):
        import torch.utils._pytree as pytree

        leaves = [m[1] if m[0] != "t" else None for m in self.leaves]
        for i, part in zip(self.order, flat.split(self.sizes)):
            _, shape, dtype_name, grad = self.leaves[i]
            dtype = getattr(torch, dtype_name)
            if grad:
                t = part.view(shape)
                leaves[i] = t.to(dtype) if dtype != t.dtype else t
            else:  # its bytes, bit for bit; its gradient does not travel back
                raw = part.detach().contiguous().view(torch.uint8)[:self._bytes(i)]
                size = torch.empty((), dtype=dtype).element_size()
                if raw.storage_offset() % size:
                    raw = raw.clone()  # aligned for the view
                leaves[i] = raw.view(dtype).view(shape)
        return pytree.tree_unflatten(leaves, self.spec)


class _ShapeFinder:
    """The activation shapes (and structures) of the running step, found
    (NOTE [Shapes found, not declared], NOTE [Pytrees between stages]). Holds
    no reference to the Pipeline."""

    def __init__(self, schedule, group, forwards: Dict[int, Callable], dtype: torch.dtype,
                 device: torch.device, comm_device: torch.device, rank: int):
        self.schedule, self.group, self.forwards = schedule, group, forwards
        self.dtype, self.device, self.comm_device, self.rank = dtype, device, comm_device, rank
        self.known: Dict[tuple, Dict[Tuple[int, int], object]] = {}
        self.outputs: Dict[Tuple[int, int], object] = {}  # (stage, mb) -> shape or _Packing
        self.probes = 0  # probes run (for tests and the curious)
        self.timeout = 300.0  # the Pipeline's

    def shape_of(self, stage: int, mb: int) -> Tuple[int, ...]:
        out = self.outputs[(stage, mb)]
        return (out.numel,) if isinstance(out, _Packing) else out

    def gradient_numel(self, stage: int, mb: int) -> int:
        """Elements of the gradient of stage's output that travel back: its
        differentiable leaves' (NOTE [Pytrees between stages])."""
        out = self.outputs[(stage, mb)]
        return out.grad_numel if isinstance(out, _Packing) else math.prod(out)

    def packing(self, stage: int, mb: int) -> Optional[_Packing]:
        out = self.outputs.get((stage, mb))
        return out if isinstance(out, _Packing) else None

    def input_packing(self, stage: int, mb: int) -> Optional[_Packing]:
        prev = self.schedule.prev_stage(stage, mb)
        return self.packing(prev, mb) if prev >= 0 else None

    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        t = t.to(self.comm_device)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        _wait(self.group.broadcast([t], opts), self.timeout,
              f"rank {self.rank}: the probe of the stages' output shapes")
        return t.cpu()

    def _broadcast_object(self, obj, root: int):
        """`obj` of rank `root` on every rank (pickled; two broadcasts)."""
        data = pickle.dumps(obj) if root == self.rank else b""
        n = self._broadcast(torch.tensor([len(data)], dtype=torch.int64), root)
        buf = torch.zeros(int(n[0]), dtype=torch.uint8)
        if root == self.rank:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return pickle.loads(self._broadcast(buf, root).numpy().tobytes())

    def rows(self, ins: List[torch.Tensor]) -> torch.Tensor:
        """This rank's row of the step's input shapes (-1 where it has no
        inputs), for the all-reduce that step() runs (NOTE [Arguments of a
        step]); a ValueError for inputs the finder cannot describe."""
        m = self.schedule.num_microbatches
        rows = torch.full((m, _MAX_DIMS + 2), -1, dtype=torch.int64)
        for mb, x in enumerate(ins):
            if x.dim() > _MAX_DIMS:
                raise ValueError(f"step(): inputs of more than {_MAX_DIMS} dimensions "
                                 "need activation_shape")
            rows[mb, 0] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -2
            rows[mb, 1] = x.dim()
            rows[mb, 2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        return rows

    def prepare(self, rows: torch.Tensor, kwargs: "_StepKwargs") -> None:
        """Before a step, with the input shapes every rank agreed on (the
        all-reduce of `rows` over the group): probe them if new."""
        m = self.schedule.num_microbatches
        if (rows[:, 1] < 0).any():
            raise ValueError("step(): the inputs' shapes are not known on any rank (no rank "
                             "that runs a first stage was given inputs)")
        if (rows[:, 0] == -2).any():
            raise ValueError("step(): an input dtype the shape finder does not know; give "
                             "activation_shape")
        inputs = [(_DTYPES[int(r[0])], tuple(int(d) for d in r[2:2 + int(r[1])])) for r in rows]
        kw_sig = [tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in kwargs.of(mb, None).items()
                               if isinstance(v, torch.Tensor))) for mb in range(m)]
        key = tuple(zip(inputs, kw_sig))
        if key not in self.known:
            self.known[key] = self._probe(inputs, kwargs, kw_sig)
        self.outputs = self.known[key]

    def _probe(self, inputs, kwargs: "_StepKwargs", kw_sig) -> Dict[Tuple[int, int], object]:
        self.probes += 1
        sched, outputs = self.schedule, {}
        done: Dict[tuple, list] = {}  # per microbatch signature: each stage's output
        for mb in range(sched.num_microbatches):
            route = sched.route(mb)
            sig = (inputs[mb], kw_sig[mb], tuple(route))
            if sig not in done:
                outs = []
                dtype, shape = inputs[mb]
                given = ("input", dtype, shape)
                for stage in route[:-1]:  # the last stage's output is the loss's
                    holder = sched.stage_rank[stage]
                    found = None
                    if holder == self.rank:
                        found = self._output(stage, mb, given, kwargs)
                    found = self._broadcast_object(found, holder)
                    if isinstance(found, str):  # the holder's error, on every rank
                        raise RuntimeError(found)
                    outs.append(found)
                    given = ("output", found)
                done[sig] = outs
            for stage, found in zip(route[:-1], done[sig]):
                outputs[(stage, mb)] = found
        return outputs

    def _output(self, stage: int, mb: int, given, kwargs):
        """Stage's output for microbatch mb: its shape (a tensor) or its
        _Packing; a str saying why it could not be found."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        fn = self.forwards[self.schedule.stage_chunk[stage]]

        def describe(out, autograd: bool):
            return (tuple(out.shape) if isinstance(out, torch.Tensor)
                    else _Packing.of(out, autograd, self.dtype))

        outer = getattr(_collecting, "sink", None)
        _collecting.sink = []  # add_loss inside the probe goes nowhere
        try:
            try:
                # Autograd on: which output leaves require grad is what the
                # probe learns besides shapes (NOTE [Pytrees between stages]).
                with torch.enable_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    if given[0] == "input":
                        x = mode.from_tensor(torch.empty(given[2], dtype=given[1],
                                                         device=self.device))
                    elif isinstance(given[1], _Packing):
                        x = given[1].fake(mode, self.device)
                    else:  # a received activation requires grad
                        x = mode.from_tensor(torch.empty(given[1], dtype=self.dtype,
                                                         device=self.device))
                        x.requires_grad_(self.dtype.is_floating_point)
                    kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                          for k, v in kwargs.of(mb, None).items()}
                    return describe(fn(x, mb, kw), autograd=True)
            except Exception:  # noqa: BLE001 - a forward fake tensors cannot run: run it for real
                with torch.no_grad():
                    if given[0] == "input":
                        x = torch.zeros(given[2], dtype=given[1], device=self.device)
                    elif isinstance(given[1], _Packing):
                        x = given[1].unpack(torch.zeros(given[1].numel, dtype=self.dtype,
                                                        device=self.device))
                    else:
                        x = torch.zeros(given[1], dtype=self.dtype, device=self.device)
                    return describe(fn(x, mb, kwargs.of(mb, None)), autograd=False)
        except Exception as e:  # noqa: BLE001
            return (f"rank {self.rank}: finding the shape of stage {stage}'s output for "
                    f"microbatch {mb} failed ({e!r}); give Pipeline(activation_shape=...)")
        finally:
            _collecting.sink = outer


# dtypes an input may have when shapes are found (their index travels).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


class _LossOfMicrobatch:
    """The loss of one microbatch: ``loss_fn(output, targets[mb])`` with the
    targets of the step that runs."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.targets: List[torch.Tensor] = []
        self.rank = -1
        self.last_outputs: Dict[int, object] = {}

    def __call__(self, output: torch.Tensor, mb: int) -> torch.Tensor:
        output = self.last_outputs.pop(mb, output)  # NOTE [Pytrees between stages]
        if not self.targets:
            raise ValueError(
                f"rank {self.rank} runs the last stage of microbatch {mb}'s route: give step() "
                "the targets"
            )
        return self.loss_fn(output, self.targets[mb])


def cpu_cache_bytes() -> int:
    """Bytes of free blocks the step cache holds: memory that CPU tensors of
    earlier steps freed, kept for the next steps' tensors
    (``Pipeline(keep_freed_memory)``)."""
    return _C.pipeline.cpu_cache_bytes()


def empty_cpu_cache() -> None:
    """Hands every free block of the step cache back to malloc (like
    ``torch.cuda.empty_cache()`` for the CUDA allocator's cache). Blocks still
    in use go back to the cache when their tensors die."""
    _C.pipeline.empty_cpu_cache()


def schedule(name: str, ranks: int, microbatches: int, chunks: int = 2) -> PipelineSchedule:
    """The named hyperparallel schedule (``1f1b``, ``zb-h1``, ``zbv``,
    ``dualpipev``, ``zb-auto``, ...; ``chunks`` is the virtual stages per rank
    of the interleaved ones): ``hyperparallel.schedule.build`` for the
    Pipeline. The model is cut into ``num_chunks`` consecutive chunks. Any
    other ``Schedule`` (``read_csv``, ``recommend``, your own) runs too."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for arg, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return _C.schedule.build(name, ranks, microbatches, chunks=chunks)


Shape = Union[Sequence[int], Callable[[int, int], Sequence[int]]]


def _group_ranks(group) -> Tuple[int, ...]:
    """The global ranks of `group`; a group that torch.distributed did not
    register (made directly from a store) is known by its size only."""
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError):
        return (-1 - group.size(),)


# NOTE [FSDP2 stages]
# A chunk may be, or contain, modules that torch's FSDP2 (`fully_shard`)
# shards over a data-parallel mesh. Why training went wrong before (issue 29;
# reproduced with tests/python/stack_worker.py's "fsdp" mode, pp 2 x dp 2,
# ZB-H1, FSDP2's hooks counted):
#  - The split was given module.parameters() as its weights: under FSDP2
#    those are the *sharded* DTensors, which the forward never touches.
#    FSDP2's pre-forward all-gathers each parameter into an *unsharded*
#    nn.Parameter (`FSDPParam._unsharded_param`, made at the first
#    all-gather and reused: only its storage is freed and refilled) and sets
#    it on the module; the graph's AccumulateGrad nodes are the unsharded
#    ones. So dw ran for weights with no path to the loss (zeros), and no
#    engine call was asked for the unsharded weights' gradients. On the
#    first stage (its input needs no gradient, so no I, and FSDP2 registers
#    no post-backward function on it) no FSDP2 hook ran at all: 0 reductions,
#    0 final callbacks in 3 steps - its weights never moved.
#  - On later stages FSDP2 reduces from autograd hooks: its post-backward
#    function sits on the module's inputs and runs as soon as the backward
#    reaches them - in I, before W. It ran with reduction on once per
#    microbatch (24 times: 2 FSDP2 groups x 4 microbatches x 3 steps), each
#    time before any gradient of the unsharded weights existed (I computes
#    dx only), and resharded: the wrong place for a once-per-step reduction
#    even with the right weights.
#  - The final callback (`_root_post_backward_final_callback`, queued with
#    `Variable._execution_engine.queue_callback` from the pre-backward hook)
#    does run under our C++ engine calls (queue_callback needs only the
#    thread's current graph task, which Engine::execute sets): 12 times, once
#    per I.
# What the runtime does instead (the idea of torch.distributed.pipelining's
# PipelineStage, which calls post_backward itself after its last backward):
#  - The split's weights are the unsharded parameters (made once at
#    construction: one all-gather and reshard per FSDP module), beside the
#    chunk's plain parameters; dp_group's reducer averages only the plain ones.
#  - During a step every FSDP2 group of the rank's stages runs with
#    requires_gradient_sync off, reshard_after_backward off, no reshard after
#    forward and is_last_backward off: FSDP2's own pre-forward all-gathers at
#    the stage's first F, its hooks in I change nothing, and the unsharded
#    weights (and their gradients, accumulated over the microbatches by dw
#    or B) stay until the step's last W.
#  - After the step each group's post_backward runs with the user's settings
#    back (normally: reduce-scatter once, reshard), then the root's final
#    callback with is_last_backward (waits for the reductions). FSDP2's
#    reduce-scatter averages over its mesh and the backward's seed is 1/m, so
#    the sharded gradients are the mean over dp x m microbatches; HSDP
#    all-reduces over the replicate dimension as well. Counted on the same
#    run: 6 reductions (2 groups x 3 steps). The step's loss is averaged over
#    FSDP2's ranks too (unless dp_group, over the same ranks, did it).
#  - Refused on every rank before the first step (_agree): a mesh dimension
#    that holds other ranks of the pipeline's group, FSDP2 and dp_group for
#    the same parameters (or over different ranks), a fully_shard'ed chunk
#    that the schedule replicates (DualPipe), a chunk whose FSDP2 root is
#    outside it.
# Memory: a stage's unsharded parameters (and their unsharded gradients) live
# from its first F to the end of the step, as the root module's do in plain
# FSDP2 training (reshard_after_forward=False); between steps only the shards.
# Resharding between F and W would need an all-gather before every I and every
# W (W's nodes may read a weight), and a reduce-scatter per microbatch would
# reduce half-made gradients, so neither is offered.


def _fsdp2_classes():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            DDPMeshInfo,
            FSDPMeshInfo,
        )
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule, FSDPMeshInfo, DDPMeshInfo


class _Fsdp2Stages:
    """The FSDP2 modules of a rank's chunks and the runtime's control of them
    (NOTE [FSDP2 stages])."""

    def __init__(self, chunks: Mapping[int, object]):
        classes = _fsdp2_classes()
        self.roots = []  # FSDPState of each chunk's top-level fully_shard'ed module
        self.groups = []  # FSDPParamGroup of every state, roots' order
        self.chunk_groups: Dict[int, list] = {}
        if classes is None:
            return
        fsdp_module, self._fsdp_mesh, self._ddp_mesh = classes
        for c, mod in chunks.items():
            if not isinstance(mod, torch.nn.Module):
                continue
            named = [(n, m) for n, m in mod.named_modules() if isinstance(m, fsdp_module)]
            names = [n for n, _ in named]
            tops = [m for n, m in named
                    if not any(o != n and (o == "" or n.startswith(o + ".")) for o in names)]
            groups = []
            for top in tops:
                state = top._get_fsdp_state()
                if any(state is r for _, r in self.roots):
                    continue  # fully_shard([m1, m2]): one state for several modules
                self.roots.append((c, state))
                for m in top.modules():
                    if isinstance(m, fsdp_module):
                        pg = m._get_fsdp_state()._fsdp_param_group
                        if pg is not None and pg not in groups:
                            groups.append(pg)
            self.chunk_groups[c] = groups
            self.groups.extend(groups)

    def __bool__(self):
        return bool(self.roots)

    def mesh_groups(self, pg) -> list:
        """The process groups FSDP2 reduces `pg`'s gradients over: the shard
        dimension's, and for HSDP the replicate dimension's."""
        mi = pg.mesh_info
        out = []
        if isinstance(mi, self._fsdp_mesh):
            out.append(mi.shard_process_group)
        if isinstance(mi, self._ddp_mesh):
            out.append(mi.replicate_process_group)
        return out

    def data_parallel_ranks(self, pg) -> set:
        return set(pg.mesh_info.mesh.mesh.flatten().tolist())

    def managed(self, c: int) -> set:
        """ids of the parameters FSDP2 manages in chunk c, sharded and unsharded."""
        ids = set()
        for pg in self.chunk_groups.get(c, []):
            for fp in pg.fsdp_params:
                ids.add(id(fp.sharded_param))
                if hasattr(fp, "_unsharded_param"):
                    ids.add(id(fp._unsharded_param))
        return ids

    def check(self, rank: int, pp_ranks: Tuple[int, ...], dp_ranks, replicated) -> Optional[str]:
        """What is wrong with these FSDP2 modules in this pipeline, or None."""
        for c, groups in self.chunk_groups.items():
            if groups and c in replicated:
                return (f"chunk {c} is fully_shard'ed and held by several ranks of the schedule "
                        "(DualPipe's mirrored copies): the runtime sums replicas' gradients "
                        "before FSDP2 reduces them, which it cannot do for sharded gradients; "
                        "use a schedule without replicas (dualpipev, zbv, ...)")
            for pg in groups:
                for g in self.mesh_groups(pg):
                    ranks = _group_ranks(g)
                    if len(set(ranks) & set(pp_ranks)) > 1:
                        return (f"chunk {c} is fully_shard'ed over a mesh dimension of ranks "
                                f"{list(ranks)}, which holds other ranks of the pipeline's group "
                                f"{list(pp_ranks)}: FSDP2 would all-gather and reduce across "
                                "pipeline stages. Shard each chunk over the data-parallel "
                                "dimension (the copies of this stage, e.g. mesh['dp'] of "
                                "init_device_mesh(..., mesh_dim_names=('dp', 'pp'))) and give "
                                "the Pipeline the 'pp' group")
                if dp_ranks is not None and self.data_parallel_ranks(pg) != set(dp_ranks):
                    return (f"chunk {c} is fully_shard'ed over ranks "
                            f"{sorted(self.data_parallel_ranks(pg))} but dp_group has ranks "
                            f"{list(dp_ranks)}: the plain parameters (dp_group) and FSDP2's "
                            "would average over different copies; use the same data-parallel "
                            "ranks for both")
        return None

    def root_check(self) -> Optional[str]:
        """Runs FSDP2's lazy initialization with each chunk's top-level
        fully_shard'ed module as the root; an error when another module is."""
        for c, state in self.roots:
            state._lazy_init()
            if not state._is_root:
                return (f"chunk {c}: its fully_shard'ed module is not FSDP2's root (an enclosing "
                        "fully_shard'ed module ran forward first): fully_shard each chunk on "
                        "its own, or its submodules, and give the Pipeline chunks that were not "
                        "run before")
            for s in state._state_ctx.all_states:
                if s._fsdp_param_group is not None and s._fsdp_param_group not in self.groups:
                    return (f"chunk {c}: FSDP2's root state reaches modules outside the chunk; "
                            "fully_shard each chunk on its own")
        return None

    def unsharded_parameters(self) -> Dict[int, Dict[int, torch.Tensor]]:
        """{chunk: {id(sharded parameter): unsharded parameter}}: one
        all-gather (and reshard) of each group that has not all-gathered yet,
        collectively over its mesh."""
        out: Dict[int, Dict[int, torch.Tensor]] = {}
        for c, groups in self.chunk_groups.items():
            for pg in groups:
                if any(not hasattr(fp, "_unsharded_param") for fp in pg.fsdp_params):
                    was_sharded = not pg.is_unsharded
                    pg.unshard()
                    pg.wait_for_unshard()
                    if was_sharded:
                        pg.reshard()
                m = out.setdefault(c, {})
                for fp in pg.fsdp_params:
                    m[id(fp.sharded_param)] = fp._unsharded_param
                    m[id(fp._unsharded_param)] = fp._unsharded_param
        return out

    def begin_step(self) -> None:
        """Every FSDP2 control as the split needs it during a step; the
        user's values kept for end_step."""
        self._saved = []
        for pg in self.groups:
            self._saved.append((pg, pg.reduce_grads, pg.all_reduce_grads,
                                pg.reshard_after_backward, pg.post_forward_mesh_info))
            pg.reduce_grads = False
            pg.all_reduce_grads = False
            pg.reshard_after_backward = False
            pg.post_forward_mesh_info = None  # no reshard after forward
        self._last = []
        for _, state in self.roots:
            self._last.append(state._state_ctx.is_last_backward)
            state._state_ctx.is_last_backward = False

    def end_step(self, ok: bool) -> None:
        """The user's controls back; after a good step, FSDP2's post-backward
        of every group (the reduce-scatter, once per step) and each root's
        final callback (waits for it)."""
        for pg, reduce, all_reduce, reshard, post_forward in self._saved:
            pg.reduce_grads, pg.all_reduce_grads = reduce, all_reduce
            pg.reshard_after_backward = reshard
            pg.post_forward_mesh_info = post_forward
        for (_, state), last in zip(self.roots, self._last):
            state._state_ctx.is_last_backward = last
        if not ok:
            return
        for _, state in self.roots:
            for s in state._state_ctx.all_states:
                if s._fsdp_param_group is not None:
                    s._fsdp_param_group.post_backward()
            state._root_post_backward_final_callback()


_AGREE_ROUNDS = 4


def _wait(work, timeout: float, what: str) -> None:
    """Waits for a collective of the Pipeline with its timeout; a
    RuntimeError naming `what` when it does not end in time."""
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeError(f"{what}: not every rank took part within {timeout} s (timeout=) "
                           f"({e})") from e


def _allreduce_max(group, t: torch.Tensor, device: torch.device, timeout: float,
                   what: str) -> torch.Tensor:
    t = t.to(device if device.type == "cuda" else torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    _wait(group.allreduce([t], opts), timeout, what)
    return t.cpu()


def _all_gather_bytes(group, data: bytes, device: torch.device, timeout: float,
                      what: str) -> List[bytes]:
    """Every rank's `data` on every rank of `group`, in group rank order: two
    all-reduces (SUM) of a tensor each rank fills its own row of."""
    p, me = group.size(), group.rank()
    dev = device if device.type == "cuda" else torch.device("cpu")
    lengths = torch.zeros(p, dtype=torch.int64, device=dev)
    lengths[me] = len(data)
    _wait(group.allreduce([lengths]), timeout, what)
    lengths = lengths.cpu().tolist()
    rows = torch.zeros((p, max(max(lengths), 1)), dtype=torch.uint8)
    if data:
        rows[me, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = rows.to(dev)
    _wait(group.allreduce([rows]), timeout, what)
    rows = rows.cpu()
    return [rows[r, :n].numpy().tobytes() for r, n in enumerate(lengths)]


# NOTE [Ranks agree on their compositions]
# Building a Pipeline is collective: each rank checks what it can see alone
# (its chunks' FSDP2 meshes, DTensor meshes, dp_group against the pipeline's
# group), and then every rank must stop with the same error before the
# runtime's construction waits on all of them. The ranks meet over
# torch.distributed's world, which every other group is a part of: one
# exchange (_all_gather_bytes) of each rank's error and of the groups its
# Pipeline uses, named by what they are for. A rank's error then stops every
# rank, each naming it; and a group that one rank uses while another of its
# members does not (FSDP2 applied on one data-parallel copy only, dp_group
# given on some copies) is the same error everywhere, at once. Before, the
# ranks met over each group they used, in turn: a rank that used a group its
# peer did not waited in it for the whole timeout and then asked whether a
# rank had failed. The world exchange needs every rank of the world to build
# its Pipeline (one at a time, in the same order), as every rank of a
# torchrun job does. A pipeline over a group torch.distributed did not make
# (no world) agrees over its groups in turn, as before.
def _agree(groups, error: Optional[str], device: torch.device, timeout: float) -> None:
    """Raises on every rank when any rank has an `error`, or when a rank uses
    a group (`groups`: [(what it is for, group)], the pipeline's group first)
    that one of its members does not (NOTE [Ranks agree on their
    compositions])."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        me = dist.get_rank()
        listed = []
        for what, g in groups:
            if g is not None and g.size() > 1 and (what, _group_ranks(g)) not in listed:
                listed.append((what, _group_ranks(g)))
        try:
            got = _all_gather_bytes(dist.group.WORLD, pickle.dumps((error, listed)), device,
                                    timeout, "the Pipeline's check of its compositions")
        except RuntimeError as e:
            raise RuntimeError(
                f"rank {me}: the ranks of torch.distributed's world did not all reach the "
                f"Pipeline's check of its compositions within {timeout} s (timeout=): every "
                "rank builds its Pipeline at the same point of its script; did a rank fail "
                f"before building its Pipeline? ({e})") from e
        views = [pickle.loads(b) for b in got]
        if error:
            raise ValueError(error)
        for r, (err, _) in enumerate(views):
            if err:
                raise ValueError(f"rank {r} refused this Pipeline: {err} (every rank stops "
                                 "with it, before the first step)")
        for r, (_, used) in enumerate(views):
            for what, ranks in used:
                if ranks[0] < 0:
                    continue  # a group torch.distributed does not know
                for q in ranks:
                    if 0 <= q < len(views) and not any(rk == ranks for _, rk in views[q][1]):
                        theirs = ", ".join(f"{w} {list(rk)}" for w, rk in views[q][1]) or "none"
                        raise ValueError(
                            f"rank {r}'s Pipeline uses {what} over ranks {list(ranks)}, but "
                            f"rank {q}, one of them, builds its Pipeline without a group of "
                            f"those ranks (its groups: {theirs}): the ranks of a group must "
                            "all use it. The copies of a pipeline are built alike: "
                            "fully_shard the chunks of every data-parallel copy or of none, "
                            "and give every copy the same dp_group and tensor-parallel layers")
        return
    uniq = {}
    groups = [g for _, g in groups]
    pp = set(_group_ranks(groups[0])) if groups and groups[0] is not None else set()
    for k, g in enumerate(groups):
        if g is None or g.size() < 2:
            continue
        ranks = _group_ranks(g)
        if k > 0 and len(set(ranks) & pp) > 1 and set(ranks) != pp:
            continue
        uniq.setdefault(ranks, g)
    if not uniq:
        if error:
            raise ValueError(error)
        return
    flag = torch.tensor([1.0 if error else 0.0], dtype=torch.float64,
                        device=device if device.type == "cuda" else torch.device("cpu"))
    order = [uniq[k] for k in sorted(uniq)]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    for _ in range(_AGREE_ROUNDS):
        for g in order:
            try:
                g.allreduce([flag], opts).wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as e:
                raise RuntimeError(
                    f"the ranks {list(_group_ranks(g))} did not all reach the Pipeline's check "
                    f"of its compositions within {timeout} s (timeout=): did a rank fail "
                    f"before building its Pipeline? ({e})"
                ) from e
    if error:
        raise ValueError(error)
    if flag[0].item() > 0:
        raise ValueError(
            "a rank of the pipeline's groups refused this Pipeline (its error says why); "
            "every rank stops with it, before the first step")


def _is_compiled(fn) -> bool:
    """Whether `fn` is, or (an nn.Module) contains, a torch.compile'd region."""
    def compiled(obj):
        cls = type(obj)
        return (cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")) \
            or hasattr(obj, "_torchdynamo_orig_callable")

    if compiled(fn):
        return True
    return isinstance(fn, torch.nn.Module) and any(compiled(m) for m in fn.modules())


def _without_donated_buffers():
    """AOTAutograd's donated buffers off for a step (NOTE [Compiled stages
    under a split schedule])."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(donated_buffer=False)


# NOTE [Compiled stages under a split schedule]
# torch.compile turns a region's backward into one autograd node
# (AOTAutograd's CompiledFunctionBackward) whose compiled graph computes the
# gradients of every input of the region together, the parameters' with the
# activations'. The dx/dw split cannot look inside it: the node leads to the
# stage's input and to weights, so I runs it (the engine keeps only dx) and
# W runs it again from the gradient I captured (the engine keeps only dw):
# the compiled region's backward runs twice per microbatch (counted with a
# counting bw_compiler in tests/python/test_stack_compile.py), with the same
# numbers each time, so the gradients are exact. I keeps the graph for W
# (keep_graph), which AOTAutograd refuses for a backward compiled with
# donated buffers (its saved activations reused as scratch, which a second
# run would read): every step of such a Pipeline runs with functorch's
# donated_buffer off, forwards and backwards, so what compiles under the
# Pipeline never donates. (AOTAutograd compiles a backward lazily, at its
# first run, and decides on donation there: under DualPipeV a region's first
# backward may be a B, and with the setting on the forwards only, its later
# I failed.) A region whose backward
# was compiled before, with donated buffers (e.g. a warm-up backward outside
# the Pipeline), still fails at its first I with AOTAutograd's own error,
# which names the setting. Fused-backward schedules (B) run it once.
# hyperparallel.compile.GraphStage is the way to a compiled stage whose
# backward really splits: dx and dw as graphs of their own, each compiled
# (NOTE [Graph stages] in python/hyperparallel/compile/stage.py).


# NOTE [Checkpoint under a split schedule]
# torch.utils.checkpoint (non-reentrant) keeps a region's recomputed
# activations per autograd graph task (`_current_graph_task_id`): I and W are
# two engine calls, so a region whose saved tensors both need (a linear's
# input: its dx needs the weight, its dw the input) recomputes in I and again
# in W - three forwards of the region per microbatch where a fused backward
# runs two (counted in tests/python/test_stack_compile.py). The reentrant
# variant runs its whole backward (dx and dw) inside I, once. The Pipeline
# cannot change torch's frames, so on a split schedule it counts, during its
# first step, the non-reentrant regions its stages enter (by wrapping
# torch.utils.checkpoint's generator for the duration of that step; the
# forwards run inside it) and warns once when there are any.
# hyperparallel.recompute.checkpoint shares one recompute: the runtime runs
# each I and W of (stage, mb) inside recompute session (stage, mb), retaining
# (NOTE [Recompute in the pipeline] in hp/pipeline/pipeline.cpp).


class _CheckpointCounter:
    """Counts torch.utils.checkpoint's non-reentrant regions entered while
    active (NOTE [Checkpoint under a split schedule])."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        import torch.utils.checkpoint as ckpt

        self._orig = ckpt._checkpoint_without_reentrant_generator

        def counting(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        ckpt._checkpoint_without_reentrant_generator = counting
        return self

    def __exit__(self, *exc):
        import torch.utils.checkpoint as ckpt

        ckpt._checkpoint_without_reentrant_generator = self._orig
        return False


def _is_expert(p: torch.Tensor) -> bool:
    # hyperparallel.moe marks the experts it sharded (is_expert_parameter).
    return getattr(p, "_hp_expert_group", None) is not None


def _expert_parallel_check(params: Dict[int, List[torch.Tensor]], dp_group) -> Optional[str]:
    """Why this rank's expert-parallel chunks cannot train with `dp_group`
    (NOTE [Expert gradients] in hp/pipeline/pipeline.cpp), or None."""
    groups = {getattr(q, "_hp_expert_group") for ps in params.values() for q in ps if _is_expert(q)}
    if not groups or groups == {(0,)}:
        return None
    if len(groups) > 1:
        return (f"this rank's chunks hold experts sharded over different groups {sorted(groups)}: "
                "convert every MoE layer of a pipeline rank with one expert-parallel group")
    (ep_ranks,) = groups
    if dp_group is None:
        return (f"this rank's experts are spread over the expert-parallel group {list(ep_ranks)} "
                "but no dp_group was given: expert parallelism is carved out of data "
                "parallelism, so give dp_group=<the expert-parallel group> (its ranks train "
                "their own parts of the batch and average the other parameters)")
    dp_ranks = tuple(_group_ranks(dp_group))
    if tuple(sorted(dp_ranks)) != tuple(sorted(ep_ranks)):
        return (f"dp_group has ranks {list(dp_ranks)} but the experts are spread over ranks "
                f"{list(ep_ranks)}: give the expert-parallel group as dp_group (a data-parallel "
                "group larger than the expert-parallel one, with experts replicated over it, is "
                "not supported yet)")
    return None


def _placement_check(chunks, params: Dict[int, List[torch.Tensor]], group,
                     dp_group) -> Optional[str]:
    """Why this rank's chunks or groups cannot make a pipeline, or None:
    parameters on the meta device, a dp_group that holds other ranks of the
    pipeline's group, a DTensor (tensor-parallel) parameter sharded over them."""
    for c, ps in params.items():
        if any(q.is_meta for q in ps):
            return (f"chunk {c}'s parameters are on the meta device (no data): materialize "
                    "the model before the Pipeline (model.to_empty(device=...) and its "
                    "initialization, or build it on a real device)")
    pp = _group_ranks(group)
    known = pp[0] >= 0
    if dp_group is not None and known:
        dp = _group_ranks(dp_group)
        if dp[0] >= 0 and len(set(dp) & set(pp)) > 1:
            return (f"dp_group has ranks {list(dp)}, which holds other ranks of the pipeline's "
                    f"group {list(pp)}: their stages' gradients would be averaged together. "
                    "dp_group joins this rank with the ranks that run the same stages in the "
                    "other copies of the pipeline (e.g. mesh['dp'] of init_device_mesh(..., "
                    "mesh_dim_names=('dp', 'pp')), with mesh['pp'] as group); without copies, "
                    "give no dp_group")
    if not known:
        return None
    for c, ps in params.items():
        for q in ps:
            mesh = getattr(q, "device_mesh", None)
            if mesh is None:
                continue
            for d in range(mesh.ndim):
                ranks = _group_ranks(mesh.get_group(d))
                if ranks[0] >= 0 and len(set(ranks) & set(pp)) > 1:
                    return (f"chunk {c} has a DTensor parameter sharded over mesh dimension {d} "
                            f"(ranks {list(ranks)}), which holds other ranks of the pipeline's "
                            f"group {list(pp)}: its collectives would run across pipeline "
                            "stages. Shard tensor-parallel layers over a dimension of their "
                            "own (e.g. mesh['tp'] of init_device_mesh(..., mesh_dim_names="
                            "('pp', 'tp'))) and give the Pipeline the 'pp' group")
    return None


class Pipeline:
    """One rank's part of a pipeline: its model chunks, run by the C++
    executor with the schedule's actions (F, I, W, B, sends, receives).

    Args:
        chunks: ``{chunk: module}`` for every chunk of ``schedule.chunks_of_rank(rank)``;
            any callable taking and returning one tensor works; its weights are
            ``module.parameters()`` that require grad (or give ``parameters``).
            A module may be, or contain, FSDP2 (``fully_shard``) modules sharded
            over the data-parallel dimension (NOTE [FSDP2 stages]: FSDP2
            reduces their gradients once per step), DTensor tensor-parallel
            layers, ``torch.compile``'d regions (on a schedule with I/W their
            backward runs in I and again in W; a RuntimeWarning says so) and
            checkpointed blocks (``hyperparallel.recompute.checkpoint``
            recomputes once per microbatch; ``torch.utils.checkpoint`` twice
            on a split schedule, with one RuntimeWarning). See docs/python.md,
            "With FSDP2, tensor parallelism, torch.compile and checkpointing".
        schedule: a :class:`PipelineSchedule` (see :func:`schedule`).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, on the last stage
            of each microbatch; the step's loss is the mean over microbatches.
        activation_shape: the shape of what one stage hands the next for one
            microbatch (a tuple), or ``fn(stage, microbatch) -> shape``; None
            (default): found from each step's input shapes, again whenever
            they change (NOTE [Shapes found, not declared]).
        group: the process group of the pipeline's ranks (default: the world);
            rank r of the group runs the schedule's rank r.
        dtype: dtype of activations and gradients between stages (default:
            the first parameter's).
        device: where received activations live (default: the first
            parameter's device).
        parameters: ``{chunk: [tensor, ...]}`` weights of callables that are not
            modules.
        timeout: seconds any wait may take before it fails naming the peer.
        dp_group: with several copies of this pipeline (data parallel), the
            group of the ranks that run this rank's stages in the other
            copies: each stage's gradients are averaged over it as soon as
            the stage has run its last microbatch, and the step's loss is the
            mean over the copies. Each copy is given its own part of the
            global batch. Only for parameters that FSDP2 does not manage
            (FSDP2 reduces its own; giving dp_group where FSDP2 manages every
            parameter is a ValueError on every rank).
        receive_lookahead: post each receive this many batches of
            sends and receives ahead of where the schedule lists it (Gloo
            only; NCCL, whose operations run in posting order, refuses more
            than 0). Default 0: ahead, a send finds its receive posted and
            goes out at once, but on the benchmark host the steps were
            slower (NOTE [Receives posted ahead] in
            hp/pipeline/executor.cpp).
        p2p: how activations and gradients travel between the ranks.
            ``"auto"`` (default): ``"shm"`` where it can work - CPU tensors
            beside a Gloo group, and every rank could reserve its rings -
            else ``"group"``, on every rank alike; a rank that could not
            reserve its rings makes every rank warn (RuntimeWarning) with
            the reason. ``"group"``: point-to-point operations of ``group``.
            ``"shm"``: between ranks of one host that the schedule's
            transfers join, rings in shared memory (``/dev/shm``, 32 MiB per
            direction and pair of such ranks, made and reserved in the
            constructor - a ``/dev/shm`` without room is a RuntimeError on
            every rank then - and unlinked once mapped), the group for the
            rest (ranks on other hosts, collectives, messages over 8 MiB).
            For a Gloo group on the CPU: Gloo carries each message over
            loopback TCP with two thread wake-ups per message, whose threads
            share the ranks' cores; the rings take neither (NOTE
            [Shared-memory point-to-point] in hp/distributed/shm_p2p.cpp).
            :attr:`p2p` says which one runs.
        keep_freed_memory: on the CPU (the default there), keep memory that
            tensors free in the process for the next ones instead of handing
            it back to the kernel after every large free, as ``hp train``
            does: glibc's malloc otherwise maps and unmaps each block above
            its threshold, and every new activation then pays a page fault
            per 4 KiB (a backward ran 10-25 % slower from that alone).
            Process-wide and permanent (glibc's ``M_MMAP_THRESHOLD`` and
            ``M_TRIM_THRESHOLD``); the process keeps its peak heap. And the
            CPU tensors of each step take their memory from the step cache:
            blocks freed by earlier steps' tensors, by size class, handed out
            without going through malloc (at most 1 GiB of free blocks is
            kept; :func:`cpu_cache_bytes`, :func:`empty_cpu_cache`; NOTE [The
            step cache] in hp/core/memory.cpp). False leaves malloc as it is.
        fb_overlap: run each ``FB`` pair of the schedule (dualpipe,
            dualpipev) as partners: the forward and the backward take turns
            on the CPU at every wait on communication (an expert dispatch or
            combine of :mod:`hyperparallel.moe`, a pipeline receive), so one
            computes while the other's message is in flight (NOTE
            [Overlapped pairs] in hp/pipeline/overlap.cpp; docs/overlap.md).
            Exact; CPU only. Default False: the forward, then the backward.
            The environment variable ``HP_LINK=LATENCY_US,GBPS`` gives this
            pipeline's transfers and the dispatchers made after it is set the
            cost of a network link, to see the overlap on one host.
    """

    def __init__(
        self,
        chunks: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
        schedule: PipelineSchedule,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        activation_shape: Optional[Shape] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        parameters: Optional[Mapping[int, Sequence[torch.Tensor]]] = None,
        timeout: float = 300.0,
        dp_group: Optional[dist.ProcessGroup] = None,
        receive_lookahead: int = 0,
        keep_freed_memory: Optional[bool] = None,
        p2p: str = "auto",
        fb_overlap: bool = False,
    ):
        if not isinstance(schedule, PipelineSchedule):
            raise TypeError(
                "schedule must be a hyperparallel Schedule "
                f"(hyperparallel.pipeline.schedule(...)), got {type(schedule).__name__}"
            )
        if not isinstance(chunks, Mapping) or not chunks:
            raise TypeError("chunks must be a non-empty dict {chunk index: module or callable}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(output, target) -> tensor")
        if (
            not isinstance(receive_lookahead, int)
            or isinstance(receive_lookahead, bool)
            or receive_lookahead < 0
        ):
            raise ValueError(
                f"receive_lookahead must be an int >= 0, got {receive_lookahead!r}"
            )
        if not isinstance(p2p, str):
            raise TypeError(
                f"p2p must be a str ('auto', 'group' or 'shm'), got {type(p2p).__name__}"
            )
        if p2p not in ("auto", "group", "shm"):
            raise ValueError(f"p2p must be 'auto', 'group' or 'shm', got {p2p!r}")
        if not isinstance(fb_overlap, bool):
            raise TypeError(f"fb_overlap must be a bool, got {type(fb_overlap).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not math.isfinite(timeout) or not 0 < timeout <= 7 * 24 * 3600:
            raise ValueError(f"timeout must be a finite number of seconds in (0, 604800], got {timeout!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}"
            )
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group first (torchrun sets its variables)"
                )
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "group must be a torch.distributed.ProcessGroup (e.g. "
                f"torch.distributed.group.WORLD after init_process_group), got {type(group)}"
            )
        if dp_group is not None and not isinstance(dp_group, dist.ProcessGroup):
            raise TypeError(
                f"dp_group must be None or a torch.distributed.ProcessGroup, got {type(dp_group)}"
            )
        forward: Dict[int, Callable] = {}
        params: Dict[int, List[torch.Tensor]] = {}
        for c, mod in chunks.items():
            if not isinstance(c, int):
                raise TypeError(f"chunk keys must be ints, got {c!r}")
            if not callable(mod):
                raise TypeError(f"chunk {c} is not callable: {type(mod).__name__}")
            forward[c] = mod
            if parameters is not None and c in parameters:
                params[c] = list(parameters[c])
            elif isinstance(mod, torch.nn.Module):
                params[c] = [q for q in mod.parameters() if q.requires_grad]
            else:
                params[c] = []
        # Compositions (NOTE [FSDP2 stages]): every rank checks its own, then
        # all agree before the runtime's construction waits on all of them.
        fsdp = _Fsdp2Stages(chunks)
        split = schedule.has_split
        error = None
        if fsdp:
            holders: Dict[int, set] = {}
            for st, c in enumerate(schedule.stage_chunk):
                holders.setdefault(c, set()).add(schedule.stage_rank[st])
            replicated = {c for c, h in holders.items() if len(h) > 1}
            dp_ranks = _group_ranks(dp_group) if dp_group is not None else None
            error = fsdp.check(group.rank(), _group_ranks(group), dp_ranks, replicated)
            if error is None and dp_group is not None:
                for c in fsdp.chunk_groups:
                    managed = fsdp.managed(c)
                    if parameters is not None and c in parameters and any(
                        id(q) in managed for q in parameters[c]
                    ):
                        error = (f"chunk {c}: parameters[{c}] lists parameters that FSDP2 "
                                 "manages (fully_shard), and dp_group was given: both would "
                                 "reduce the same gradients; leave FSDP2's parameters out of "
                                 "parameters= (the runtime finds them)")
                if error is None and all(
                    all(id(q) in fsdp.managed(c) for q in params[c]) for c in params
                ):
                    mesh = sorted(fsdp.data_parallel_ranks(fsdp.groups[0]))
                    error = ("dp_group was given, but FSDP2 (fully_shard) manages every "
                             f"parameter of this rank's chunks {sorted(params)} and already "
                             f"averages their gradients over ranks {mesh}: dp_group and FSDP2 "
                             "would reduce the same parameters. Drop dp_group (the step's loss "
                             "is averaged over FSDP2's ranks), or keep it for parameters "
                             "FSDP2 does not manage")
            if error is None:
                try:  # FSDP2's own checks raise here; every rank must still agree
                    error = fsdp.root_check()
                except Exception as e:  # noqa: BLE001 - reported through _agree
                    error = f"FSDP2's initialization of this rank's chunks failed: {e!r}"

        if error is None:
            error = _expert_parallel_check(params, dp_group)
        if error is None and fsdp and activation_shape is None:
            # NOTE [FSDP2 stages need declared shapes]: finding shapes runs a
            # stage's forward on fake tensors (or, where those fail, for real
            # under no_grad); through FSDP2's hooks either left the unsharded
            # parameters the steps then read garbage (NaN losses), so the
            # composition is refused rather than run wrong.
            error = ("FSDP2 (fully_shard) stages need declared activation shapes: give "
                     "Pipeline(activation_shape=...) (a shape, or fn(stage, microbatch) -> "
                     "shape); finding them runs the forward outside FSDP2's control, which left "
                     "its unsharded parameters unset")
        if error is None:
            error = _placement_check(chunks, params, group, dp_group)
        agree_on = [("the pipeline's group", group), ("dp_group", dp_group)]
        for c, groups in fsdp.chunk_groups.items():
            agree_on.extend((f"FSDP2's mesh of chunk {c}", g)
                            for pg in groups for g in fsdp.mesh_groups(pg))
        for c, ps in params.items():
            for q in ps:
                mesh = getattr(q, "device_mesh", None)
                if mesh is not None:
                    agree_on.extend((f"the DTensor mesh of chunk {c}'s parameters",
                                     mesh.get_group(d)) for d in range(mesh.ndim))
        compiled = sorted(c for c, fn in chunks.items() if _is_compiled(fn))
        # The whole step, forwards and backwards: AOTAutograd compiles a
        # region's backward lazily, at its first run.
        self._step_context = _without_donated_buffers if split and compiled else None
        if split and compiled:
            warnings.warn(
                f"Pipeline: chunk(s) {compiled} are torch.compile'd and this schedule splits "
                "backwards into I (dx) and W (dw): a compiled region's backward is one "
                "autograd node that computes dx and dw together, so it runs whole in I and "
                "again in W (twice per microbatch; exact, donated buffers off). A schedule "
                "without I/W (1f1b, interleaved-1f1b, gpipe) runs it once; "
                "hyperparallel.compile.GraphStage(module, backend='inductor') compiles a "
                "chunk with its backward split into dx and dw graphs (NOTE [Graph stages])",
                RuntimeWarning,
                stacklevel=2,
            )
        # NOTE [Auxiliary losses]: every chunk's forward collects add_loss().
        # NOTE [Keyword arguments of every stage]: and the step's kwargs.
        self._aux = _AuxiliarySum(1.0 / schedule.num_microbatches)
        self._kwargs = _StepKwargs()
        for c in forward:
            forward[c] = _StageForward(forward[c], self._aux, self._kwargs,
                                       _accepted_kwargs(chunks[c]))
        first = next((q for ps in params.values() for q in ps), None)
        _agree(agree_on, error,
               torch.device(device) if device is not None else
               (first.device if first is not None else torch.device("cpu")),
               float(timeout))
        dp_params: Dict[int, List[torch.Tensor]] = {}
        self._fsdp = fsdp if fsdp else None
        # The first step of a split schedule looks for torch.utils.checkpoint
        # (NOTE [Checkpoint under a split schedule]).
        self._watch_checkpoints = split
        self._loss_groups: List[dist.ProcessGroup] = []
        if self._fsdp is not None:
            unsharded = fsdp.unsharded_parameters()
            for c, ps in params.items():
                swap = unsharded.get(c, {})
                if not swap:
                    continue
                mine = [swap.get(id(q), q) for q in ps if q.requires_grad]
                # FSDP2 reduces every parameter of its modules: each is a
                # weight of the split, listed in parameters= or not.
                seen = {id(q) for q in mine}
                for u in swap.values():
                    if id(u) not in seen and u.requires_grad:
                        seen.add(id(u))
                        mine.append(u)
                dp_params[c] = [q for q in mine if id(q) not in swap]
                params[c] = mine
            dp_ranks = _group_ranks(dp_group) if dp_group is not None else None
            seen_groups = set()
            for pg in fsdp.groups:
                for g in fsdp.mesh_groups(pg):
                    ranks = _group_ranks(g)
                    if ranks in seen_groups or g.size() < 2:
                        continue
                    seen_groups.add(ranks)
                    if dp_ranks is None or set(dp_ranks) != fsdp.data_parallel_ranks(pg):
                        self._loss_groups.append(g)
            # Activations are in the unsharded parameters' dtype (FSDP2's param_dtype).
            first = next((q for ps in params.values() for q in ps), None)
        if dtype is None:
            dtype = first.dtype if first is not None else torch.get_default_dtype()
        if device is None:
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)
        # FSDP2's groups take the loss where they take gradients (NCCL: CUDA).
        self._loss_device = device if device.type == "cuda" else torch.device("cpu")
        if keep_freed_memory is None:
            keep_freed_memory = device.type == "cpu"
        if not isinstance(keep_freed_memory, bool):
            raise TypeError(
                f"keep_freed_memory must be None or a bool, got {type(keep_freed_memory).__name__}"
            )
        if keep_freed_memory:
            _C.pipeline.keep_freed_memory_mapped()
        self._finder: Optional[_ShapeFinder] = None
        if activation_shape is None:
            # NOTE [Shapes found, not declared]
            self._finder = _ShapeFinder(
                schedule, group, {c: f.probe for c, f in forward.items()}, dtype, device,
                self._loss_device, group.rank())
            self._finder.timeout = float(timeout)
            shape = self._finder.shape_of
            for f in forward.values():  # NOTE [Pytrees between stages]
                f.finder, f.dtype = self._finder, dtype
        elif callable(activation_shape):
            shape_fn = activation_shape

            def shape(stage: int, mb: int) -> Tuple[int, ...]:
                got = shape_fn(stage, mb)
                if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in got
                ):
                    raise TypeError(
                        f"activation_shape({stage}, {mb}) must return a sequence of ints >= 0 "
                        f"(a shape), got {got!r}"
                    )
                return tuple(got)

        else:
            if isinstance(activation_shape, (str, bytes)) or not isinstance(activation_shape, Sequence):
                raise TypeError(
                    "activation_shape must be a shape (a sequence of ints) or "
                    f"fn(stage, microbatch) -> shape, got {activation_shape!r}"
                )
            shape = tuple(int(d) for d in activation_shape)  # read once by the runtime
        # The runtime holds the loss, which must not hold the Pipeline: that
        # cycle through a C++ object is never collected, and the group would
        # live until the interpreter's shutdown (NOTE [A Pipeline's group dies
        # with it] in python/csrc/bind_pipeline.cpp).
        self._loss = _LossOfMicrobatch(loss_fn)
        for f in forward.values():
            f.schedule, f.last_outputs = schedule, self._loss.last_outputs
        self.schedule = schedule
        # Parameters that chunks of several ranks share (tied embeddings):
        # summed over their holders after each step (NOTE [Parameters shared
        # by chunks] in split_model.py).
        self._shared = _SharedGradients(chunks, schedule, group, float(timeout))
        self._runtime = _C.pipeline.Runtime(
            schedule,
            group,
            forward,
            params,
            self._loss,
            shape,
            dtype,
            device,
            float(timeout),
            dp_group,
            receive_lookahead,
            p2p,
            keep_freed_memory,
            dp_params,
            split,
            self._aux.take,
            failure_store=dist.distributed_c10d._world.pg_map.get(group, (None, None))[1],
            gradient_numel=None if self._finder is None else self._finder.gradient_numel,
            chunk_expert_parameters={c: [q for q in ps if _is_expert(q)] for c, ps in params.items()},
            dp_failure_store=None if dp_group is None else
            dist.distributed_c10d._world.pg_map.get(dp_group, (None, None))[1],
            fb_overlap=fb_overlap,
        )
        self.rank = self._runtime.rank
        self._loss.rank = self.rank
        self._group, self._timeout = group, float(timeout)
        self._broken: Optional[str] = None  # why this rank left a step (NOTE [Arguments of a step])
        self._kw_fp: Optional[int] = None  # the last agreed step's keyword arguments
        # The keyword arguments some chunk of the pipeline takes, on any rank
        # (None: one takes any): a step's key outside them is a mistake.
        accepts = [_accepted_kwargs(chunks[c]) for c in chunks]
        mine = None if any(a is None for a in accepts) else sorted(set().union(*accepts))
        if group.size() > 1:
            every = [pickle.loads(b) for b in _all_gather_bytes(
                group, pickle.dumps(mine), self._loss_device, self._timeout,
                f"rank {self.rank}: the Pipeline's exchange of its stages' keyword arguments")]
        else:
            every = [mine]
        self._known_kwargs = (None if any(e is None for e in every)
                              else frozenset().union(*map(frozenset, every)))
        #: The point-to-point in use on this rank: "shm" (rings beside the group
        #: to the ranks of its host that it exchanges with) or "group".
        self.p2p = "shm" if self._runtime.backend.endswith("+shm") else "group"
        if self._runtime.p2p_note:
            warnings.warn(
                f"Pipeline(p2p='auto') uses the group's point-to-point: {self._runtime.p2p_note}",
                RuntimeWarning,
                stacklevel=2,
            )
        self.last_stats: Dict[str, object] = {}

    @staticmethod
    def _split(batch, m: int, what: str) -> List[torch.Tensor]:
        if batch is None:
            return []
        if isinstance(batch, torch.Tensor):
            if batch.shape[0] % m != 0:
                raise ValueError(
                    f"{what}: the batch's first dimension ({batch.shape[0]}) is not divisible by "
                    f"the {m} microbatches"
                )
            return list(batch.chunk(m))
        parts = list(batch)
        if len(parts) != m:
            raise ValueError(f"{what}: {len(parts)} microbatches given, the schedule has {m}")
        for k, t in enumerate(parts):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}[{k}] is a {type(t).__name__}, not a tensor")
        return parts

    def _split_kwargs(self, kwargs, m: int):
        """The step's keyword arguments: per microbatch (tensors) and constant."""
        per_mb: List[Dict[str, object]] = []
        constant: Dict[str, object] = {}
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                if value.requires_grad:
                    raise ValueError(
                        f"step(): keyword argument {key!r} requires grad, but keyword arguments "
                        "carry no gradient back between ranks; pass it detached, or compute it "
                        "inside a stage")
                if value.dim() == 0:
                    raise ValueError(
                        f"step(): keyword argument {key!r} is a 0-d tensor; tensors are split "
                        f"into the {m} microbatches along dim 0 (pass a number for a constant)")
                parts = self._split(value, m, f"keyword argument {key!r}")
                if not per_mb:
                    per_mb = [{} for _ in range(m)]
                for k in range(m):
                    per_mb[k][key] = parts[k]
            else:
                constant[key] = value
        return per_mb, constant

    def _agree_on_step(self, fingerprint: int, signature, error, rows):
        """The ranks' agreement before a step (NOTE [Arguments of a step]):
        one all-reduce (MAX) of each rank's keyword-argument fingerprint and
        error flag, beside the input shapes when they are found. Raises on
        every rank when a rank's arguments were refused or the keyword
        arguments differ; returns the reduced shape rows."""
        p, me = self._group.size(), self._group.rank()
        flags = torch.full((2 * p,), -1, dtype=torch.int64)
        flags[me], flags[p + me] = fingerprint, 1 if error is not None else 0
        n = 0 if rows is None else rows.numel()
        if self._finder is not None and rows is None:  # this rank's arguments were refused
            rows = self._finder.rows([])
            n = rows.numel()
        both = flags if rows is None else torch.cat([rows.reshape(-1), flags])
        what = ("the check of step()'s arguments (a rank whose keyword arguments changed "
                "from its previous step checks them with the others; did theirs not change?)")
        if self._finder is not None:
            what = "the step's agreement on its input shapes and arguments"
        reduced = _allreduce_max(self._group, both, self._loss_device, self._timeout,
                                 f"rank {self.rank}: {what}")
        flags = reduced[n:]
        failed = [r for r in range(p) if flags[p + r] == 1]
        if failed:
            msgs = self._gather_text("" if error is None else str(error),
                                     "the exchange of refused step() arguments")
            if error is not None:
                raise error
            raise ValueError(
                f"rank {failed[0]}'s step() refused its arguments: {msgs[failed[0]]} (no rank "
                "ran this step; the Pipeline stays usable)")
        if any(flags[r] != flags[0] for r in range(p)):
            texts = self._gather_text(_describe_kwargs(signature),
                                      "the exchange of step()'s keyword arguments")
            raise ValueError(
                "step()'s keyword arguments differ across the pipeline's ranks: "
                + "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
                + ". Every rank's step() is given the same keyword arguments (the same keys, "
                "shapes, dtypes and constant values): each stage takes its own from them, "
                "and a rank given others trains another model (no rank ran this step)")
        return None if rows is None else reduced[:n].reshape(rows.shape)

    def _gather_text(self, text: str, what: str) -> List[str]:
        return [b.decode() for b in _all_gather_bytes(
            self._group, text.encode(), self._loss_device, self._timeout,
            f"rank {self.rank}: {what}")]

    def step(self, inputs=None, targets=None, **kwargs) -> float:
        """Runs one step: forward and backward of every microbatch of this
        rank's stages, weight gradients accumulated into ``.grad``. ``inputs``
        (needed on the ranks running a route's first stage) and ``targets``
        (on those running a last stage) are a batch tensor split into the
        schedule's microbatches along dim 0, or a list of one tensor per
        microbatch. Keyword arguments go to every stage whose forward takes
        them (NOTE [Keyword arguments of every stage]): a tensor is split
        into the microbatches along dim 0 (``attention_mask``,
        ``position_ids``), anything else is handed on unchanged. Returns the
        mean loss over the microbatches, on every rank; ``last_stats`` has
        the step's timings, ``aux_loss`` (NOTE [Auxiliary losses]) and, with
        ``fb_overlap``, ``pairs``, ``pair_hidden`` and ``pair_exposed`` (the
        overlapped pairs and their waits' seconds hidden and exposed)."""
        if self._broken is not None:
            raise RuntimeError(
                f"a previous step failed on this rank ({self._broken}); its peers' steps "
                "failed with it: make a new Pipeline")
        m = self.schedule.num_microbatches
        signature = _kwargs_signature(kwargs)
        fingerprint = int.from_bytes(
            hashlib.blake2b(repr(signature).encode(), digest_size=8).digest(), "little") >> 2
        ins: List[torch.Tensor] = []
        tgts: List[torch.Tensor] = []
        per_mb: List[Dict[str, object]] = []
        constant: Dict[str, object] = {}
        rows = None
        error: Optional[Exception] = None
        try:  # NOTE [Arguments of a step]: this rank's own checks, no communication
            if self._known_kwargs is not None:
                unknown = sorted(k for k in kwargs if k not in self._known_kwargs)
                if unknown:
                    raise ValueError(
                        f"step(): keyword argument(s) {unknown} are taken by no stage of the "
                        f"pipeline (their forwards take {sorted(self._known_kwargs)}): a "
                        "misspelt name would be dropped without a word; pass only what a "
                        "stage's forward takes")
            ins = self._split(inputs, m, "inputs")
            tgts = self._split(targets, m, "targets")
            per_mb, constant = self._split_kwargs(kwargs, m)
            if not ins and self.schedule.needs_inputs(self.rank):
                raise ValueError(
                    f"rank {self.rank} runs a route's first stage: give step() the inputs")
            if not tgts and self.schedule.needs_targets(self.rank):
                raise ValueError(
                    f"rank {self.rank} runs a route's last stage: give step() the targets")
            if self._finder is not None:
                rows = self._finder.rows(ins)
        except Exception as e:  # noqa: BLE001 - raised below, after the peers are told
            error = e
        # The agreement: always with shapes found; with a declared shape on
        # the first step, and on a later one whose keyword arguments changed
        # on this rank (a rank whose own checks failed then tells its peers
        # by abandoning instead: they may already wait in the step).
        if self._group.size() > 1 and (self._finder is not None or self._kw_fp is None or (
                error is None and fingerprint != self._kw_fp)):
            rows = self._agree_on_step(fingerprint, signature, error, rows)
        elif error is not None:
            if self._group.size() > 1:
                # The peers may already wait in this step for this rank.
                why = f"rank {self.rank}'s step() refused its arguments: {error}"
                self._broken = why
                self._runtime.abandon(why)
            raise error
        self._kw_fp = fingerprint
        self._kwargs.per_microbatch, self._kwargs.constant = per_mb, constant
        if self._finder is not None:
            try:
                self._finder.prepare(rows, self._kwargs)
            except BaseException:
                self._kwargs.per_microbatch, self._kwargs.constant = [], {}
                raise
        self._loss.targets = tgts
        ok = False
        if self._fsdp is not None:
            self._fsdp.begin_step()
        counter = _CheckpointCounter() if self._watch_checkpoints else None
        try:
            with contextlib.ExitStack() as scope:
                if counter is not None:
                    scope.enter_context(counter)
                if self._step_context is not None:
                    scope.enter_context(self._step_context())
                stats = self._runtime.step(ins)
                if self._shared:
                    self._shared.sum()
            ok = True
        finally:
            self._loss.targets = []
            self._kwargs.per_microbatch, self._kwargs.constant = [], {}
            self._loss.last_outputs.clear()
            if self._fsdp is not None:
                self._fsdp.end_step(ok)
        if counter is not None:
            self._watch_checkpoints = False
            if counter.count:
                warnings.warn(
                    f"Pipeline: rank {self.rank}'s stages run torch.utils.checkpoint regions "
                    f"({counter.count} in this step) under a schedule that splits backwards "
                    "into I and W: each recomputes in I and again in W, twice per microbatch "
                    "on a stage that sends a gradient back (torch keeps a recompute for one "
                    "autograd engine call, and I and W are two). "
                    "hyperparallel.recompute.checkpoint recomputes once: the Pipeline runs I "
                    "and W of a microbatch in one retaining recompute session",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self._loss_groups:
            # The step's loss (and auxiliary losses): the mean over FSDP2's
            # data-parallel ranks too.
            sums = torch.tensor([stats["loss"], stats["extra"]], dtype=torch.float64,
                                device=self._loss_device)
            for g in self._loss_groups:
                _wait(g.allreduce([sums]), self._timeout,
                      f"rank {self.rank}: the step's loss over FSDP2's data-parallel ranks")
                sums /= g.size()
            stats["loss"], stats["extra"] = sums.tolist()
        # NOTE [Auxiliary losses]: their mean over microbatches, every rank's.
        stats["aux_loss"] = stats.pop("extra")
        self.last_stats = stats
        return stats["loss"]
