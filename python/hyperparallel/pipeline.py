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

import datetime
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C

__all__ = ["PipelineSchedule", "schedule", "Pipeline", "cpu_cache_bytes", "empty_cpu_cache"]


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's placement, as the runtime needs it: which rank runs each
    virtual stage and which model chunk each stage computes. ``csv`` is the
    schedule itself (hyperparallel's CSV form, see docs/schedules.md)."""

    csv: str
    num_ranks: int
    num_stages: int
    num_chunks: int
    num_microbatches: int
    stage_rank: Tuple[int, ...]
    stage_chunk: Tuple[int, ...]
    first_stages: Tuple[int, ...] = ()  # the first stage of each route (reads the inputs)
    last_stages: Tuple[int, ...] = ()  # the last stage of each route (computes the loss)

    @staticmethod
    def from_csv(csv: str) -> "PipelineSchedule":
        """A schedule from its CSV text (e.g. written by ``hp schedule tune``)."""
        if not isinstance(csv, str):
            raise TypeError(f"csv must be a str, got {type(csv).__name__}")
        lay = _C.pipeline.layout(csv)
        return PipelineSchedule(
            csv=csv,
            num_ranks=lay["num_ranks"],
            num_stages=lay["num_stages"],
            num_chunks=lay["num_chunks"],
            num_microbatches=lay["num_microbatches"],
            stage_rank=tuple(lay["stage_rank"]),
            stage_chunk=tuple(lay["stage_chunk"]),
            first_stages=tuple(lay["first_stages"]),
            last_stages=tuple(lay["last_stages"]),
        )

    def stages_of_rank(self, rank: int) -> List[int]:
        """The virtual stages ``rank`` runs, in increasing order."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def needs_inputs(self, rank: int) -> bool:
        """Whether ``rank`` runs the first stage of a route (reads microbatch inputs)."""
        return any(self.stage_rank[s] == rank for s in self.first_stages)

    def needs_targets(self, rank: int) -> bool:
        """Whether ``rank`` runs the last stage of a route (computes losses)."""
        return any(self.stage_rank[s] == rank for s in self.last_stages)

    def chunks_of_rank(self, rank: int) -> List[int]:
        """The model chunks ``rank`` must hold (one module each), in increasing order.
        A chunk held by several ranks (DualPipe's mirrored copies) is a replica:
        give every holder the same initial weights; their gradients are summed."""
        return sorted({self.stage_chunk[s] for s in self.stages_of_rank(rank)})


class _LossOfMicrobatch:
    """The loss of one microbatch: ``loss_fn(output, targets[mb])`` with the
    targets of the step that runs."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.targets: List[torch.Tensor] = []
        self.rank = -1

    def __call__(self, output: torch.Tensor, mb: int) -> torch.Tensor:
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
    of the interleaved ones). The model is cut into ``num_chunks`` consecutive
    chunks."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for arg, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return PipelineSchedule.from_csv(_C.pipeline.schedule_csv(name, ranks, microbatches, chunks))


Shape = Union[Sequence[int], Callable[[int, int], Sequence[int]]]


class Pipeline:
    """One rank's part of a pipeline: its model chunks, run by the C++
    executor with the schedule's actions (F, I, W, B, sends, receives).

    Args:
        chunks: ``{chunk: module}`` for every chunk of ``schedule.chunks_of_rank(rank)``;
            any callable taking and returning one tensor works; its weights are
            ``module.parameters()`` that require grad (or give ``parameters``).
        schedule: a :class:`PipelineSchedule` (see :func:`schedule`).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, on the last stage
            of each microbatch; the step's loss is the mean over microbatches.
        activation_shape: the shape of what one stage hands the next for one
            microbatch (a tuple), or ``fn(stage, microbatch) -> shape``.
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
            global batch.
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
    """

    def __init__(
        self,
        chunks: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
        schedule: PipelineSchedule,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        activation_shape: Shape,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        parameters: Optional[Mapping[int, Sequence[torch.Tensor]]] = None,
        timeout: float = 300.0,
        dp_group: Optional[dist.ProcessGroup] = None,
        receive_lookahead: int = 0,
        keep_freed_memory: Optional[bool] = None,
        p2p: str = "auto",
    ):
        if not isinstance(schedule, PipelineSchedule):
            raise TypeError(
                "schedule must be a hyperparallel.pipeline.PipelineSchedule "
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
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group first (torchrun sets its variables)"
                )
            group = dist.group.WORLD
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
        first = next((q for ps in params.values() for q in ps), None)
        if dtype is None:
            dtype = first.dtype if first is not None else torch.get_default_dtype()
        if device is None:
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)
        if keep_freed_memory is None:
            keep_freed_memory = device.type == "cpu"
        if not isinstance(keep_freed_memory, bool):
            raise TypeError(
                f"keep_freed_memory must be None or a bool, got {type(keep_freed_memory).__name__}"
            )
        if keep_freed_memory:
            _C.pipeline.keep_freed_memory_mapped()
        if callable(activation_shape):
            shape = activation_shape
        else:
            shape = tuple(int(d) for d in activation_shape)  # read once by the runtime
        # The runtime holds the loss, which must not hold the Pipeline: that
        # cycle through a C++ object is never collected, and the group would
        # live until the interpreter's shutdown (NOTE [A Pipeline's group dies
        # with it] in python/csrc/bind_pipeline.cpp).
        self._loss = _LossOfMicrobatch(loss_fn)
        self.schedule = schedule
        self._runtime = _C.pipeline.Runtime(
            schedule.csv,
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
        )
        self.rank = self._runtime.rank
        self._loss.rank = self.rank
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

    def step(self, inputs=None, targets=None) -> float:
        """Runs one step: forward and backward of every microbatch of this
        rank's stages, weight gradients accumulated into ``.grad``. ``inputs``
        (needed on the ranks running a route's first stage) and ``targets``
        (on those running a last stage) are a batch tensor split into the
        schedule's microbatches along dim 0, or a list of one tensor per
        microbatch. Returns the mean loss over the microbatches, on every rank."""
        m = self.schedule.num_microbatches
        ins = self._split(inputs, m, "inputs")
        tgts = self._split(targets, m, "targets")
        if not ins and self.schedule.needs_inputs(self.rank):
            raise ValueError(f"rank {self.rank} runs a route's first stage: give step() the inputs")
        if not tgts and self.schedule.needs_targets(self.rank):
            raise ValueError(f"rank {self.rank} runs a route's last stage: give step() the targets")
        self._loss.targets = tgts
        try:
            stats = self._runtime.step(ins)
        finally:
            self._loss.targets = []
        self.last_stats = stats
        return stats["loss"]
