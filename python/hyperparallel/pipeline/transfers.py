"""What one stage hands the next: the shapes found for each step
(_ShapeFinder, NOTE [Shapes found, not declared]) and the packing of a
structure of tensors into the one tensor a transfer moves (_Packing, NOTE
[Pytrees between stages])."""

from __future__ import annotations

import math
import pickle
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..losses import _collecting
from .checks import _wait

if TYPE_CHECKING:  # pragma: no cover
    from .stage_forward import _StepKwargs


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


def _activation_shapes(activation_shape, schedule, group, forward, dtype, device, comm_device,
                       timeout):
    """The shapes the runtime's receives are given, as (finder, shape):
    found by a _ShapeFinder (NOTE [Shapes found, not declared]; the stage
    forwards get it too), or declared (finder None): a function, its answers
    checked at each call, or one shape."""
    finder = None
    if activation_shape is None:
        # NOTE [Shapes found, not declared]
        finder = _ShapeFinder(
            schedule, group, {c: f.probe for c, f in forward.items()}, dtype, device,
            comm_device, group.rank())
        finder.timeout = float(timeout)
        shape = finder.shape_of
        for f in forward.values():  # NOTE [Pytrees between stages]
            f.finder, f.dtype = finder, dtype
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
    return finder, shape
