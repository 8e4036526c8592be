"""The runtime, :class:`Pipeline`: train your own ``nn.Module`` stages with
any hyperparallel schedule.

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
import hashlib
import pickle
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import _C
from ..losses import _AuxiliarySum, _LossOfMicrobatch
from .checks import (
    _CheckpointCounter,
    _agree,
    _check_arguments,
    _all_gather_bytes,
    _allreduce_max,
    _compiled_step_context,
    _composition_error,
    _group_ranks,
    _groups_to_agree_on,
    _is_expert,
    _resolve_pair_turns,
)
from .fsdp2 import _Fsdp2Stages
from .helpers import PipelineSchedule
from .stage_forward import (
    _StageForward,
    _StepKwargs,
    _accepted_kwargs,
    _describe_kwargs,
    _kwargs_signature,
)
from .chunk_pairs import _ChunkPairs, pair_hook
from .transfers import _declared_shape

__all__ = ["Pipeline", "OVERLAP_F_B"]

#: What Pipeline.register_custom_function replaces: how an ``FB`` pair runs
#: (torch's ``_ComputationType.OVERLAP_F_B`` is taken too).
OVERLAP_F_B = "OVERLAP_F_B"


Shape = Union[Sequence[int], Callable[[int, int], Sequence[int]]]


def _forwards_and_parameters(chunks, parameters):
    """Each chunk's forward and its weights: ``parameters[c]`` where given,
    else a module's parameters that require grad (none for a callable)."""
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
    return forward, params


def _parameter_names(chunks, params) -> Dict[int, List[str]]:
    """Names of the chunks' parameters for the C++ Pipeline, which sums the
    gradient of a name held on several ranks over them (NOTE [Parameters
    shared by chunks] in split_model.py): a parameter that split_model's
    chunks share (a tied head) goes by its model-wide name, every other by
    chunk and position, as the Pipeline names what it is not told."""
    names: Dict[int, List[str]] = {}
    for c, ps in params.items():
        shared = getattr(chunks[c], "shared_parameters", None)
        if not shared:
            continue
        by_id = {id(q): n for n, q in chunks[c].named_model_parameters() if n in shared}
        names[c] = [by_id.get(id(q), f"chunk{c}.{i}") for i, q in enumerate(ps)]
    return names


def _dtype_and_device(dtype, device, first, keep_freed_memory):
    """The dtype and device of activations (by default the first weight's)
    and keep_freed_memory (by default on the CPU), checked; the process then
    keeps freed memory mapped if asked."""
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
    return dtype, device, keep_freed_memory


def _is_overlap_kind(kind) -> bool:
    if kind == OVERLAP_F_B:
        return True
    try:  # torch's own name for it
        from torch.distributed.pipelining.schedules import _ComputationType
    except ImportError:  # pragma: no cover  (torch without pipelining)
        return False
    return kind is getattr(_ComputationType, "OVERLAP_F_B", None)


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
            microbatch (a tuple), or ``fn(stage, microbatch) -> shape``: one
            tensor of ``dtype``, received into buffers of that shape. None
            (default): a stage hands the next a tensor or a structure of
            them, each tensor in its own dtype and shape, which travel with
            it (NOTE [Pytrees between stages]); nothing is declared, probed or
            agreed on, whatever the shapes of a step.
        group: the process group of the pipeline's ranks (default: the world);
            rank r of the group runs the schedule's rank r.
        dtype: with ``activation_shape``, the dtype of activations and
            gradients between stages (default: the first parameter's).
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
        expert_dp_group: where the expert-parallel group of
            ``hyperparallel.moe.expert_parallel`` is smaller than dp_group
            (inside it): the ranks of dp_group holding this rank's experts,
            one in each expert-parallel group. Their expert gradients are
            summed over it, then divided by dp_group's size (NOTE [Expert
            gradients] in hp/pipeline/pipeline.cpp).
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
            Exact. On CUDA each half issues on a stream of its own (NOTE [An
            overlapped pair on a device]). Default False: the forward, then
            the backward.
            The environment variable ``HP_LINK=LATENCY_US,GBPS`` gives this
            pipeline's transfers and the dispatchers made after it is set the
            cost of a network link, to see the overlap on one host.
        defer_wgrad: with ``fb_overlap``, True: each pair's backward
            computes its input gradient only and queues its weight gradient,
            which runs in a later wait that nothing else fills, or at the
            step's end (NOTE [Weight gradients in the waits] in
            hp/pipeline/overlap.cpp). Exact; its weight gradients hold their
            activations longer. ``last_stats`` counts them
            (``deferred_w_in_waits``, ``deferred_w_at_end``). ``"auto"`` (the
            default): after the second step, :meth:`choose_deferred_w` with
            :attr:`defer_wgrad_gain` turns them on where the simulator,
            under that step's measured costs, predicts a shorter step. False:
            never.
        pair_turns: how a pair's halves take the CPU. ``"fixed"`` (the
            default): in the code's order, at every wait. ``"ready"``: the
            half whose message arrived first goes on (NOTE [Turns as
            messages arrive] in hp/pipeline/overlap.cpp); ``"auto"``: ready
            without deferred W's, fixed with them (``hp train``'s default).
            Ready turns need every exchange inside a chunk to be
            :mod:`hyperparallel.moe`'s: not with FSDP2, DTensor parameters,
            a device, or a chunk's own ``torch.distributed`` calls (NOTE
            [Ready turns from Python] in hyperparallel/pipeline/checks.py).
            A deferred W that would exchange under them (a recomputed expert
            layer) fails the step; ``"auto"``'s choice never defers one there.
        w_parts: with ``defer_wgrad=True`` and ``pair_turns="ready"``, each
            deferred W runs in this many parts, taken until the awaited
            message is there (``hp train --w-parts``). Default 1: whole.
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
        expert_dp_group: Optional[dist.ProcessGroup] = None,
        receive_lookahead: int = 0,
        keep_freed_memory: Optional[bool] = None,
        p2p: str = "auto",
        fb_overlap: bool = False,
        defer_wgrad: Union[bool, str] = "auto",
        pair_turns: str = "fixed",
        w_parts: int = 1,
    ):
        group = _check_arguments(chunks, schedule, loss_fn, receive_lookahead, p2p,
                                 (fb_overlap, defer_wgrad, pair_turns, w_parts),
                                 timeout, dtype, group, dp_group, expert_dp_group)
        forward, params = _forwards_and_parameters(chunks, parameters)
        # Compositions (NOTE [FSDP2 stages]): every rank checks its own, then
        # all agree before the runtime's construction waits on all of them.
        fsdp = _Fsdp2Stages(chunks)
        split = schedule.has_split
        error = _composition_error(fsdp, schedule, chunks, params, parameters, group, dp_group,
                                   expert_dp_group)
        first = next((q for ps in params.values() for q in ps), None)
        at = (torch.device(device) if device is not None else
              (first.device if first is not None else torch.device("cpu")))
        #: The turns the pairs take: ``pair_turns``, or "fixed" where ready
        #: turns cannot be (NOTE [Ready turns from Python] in checks.py).
        self.pair_turns, refused = _resolve_pair_turns(pair_turns, at, fsdp, params)
        error = error or refused
        agree_on = _groups_to_agree_on(group, dp_group, fsdp, params, expert_dp_group)
        self._step_context = _compiled_step_context(chunks, split)
        # NOTE [Auxiliary losses]: every chunk's forward collects add_loss().
        # NOTE [Keyword arguments of every stage]: and the step's kwargs.
        self._aux = _AuxiliarySum(1.0 / schedule.num_microbatches)
        self._kwargs = _StepKwargs()
        for c in forward:
            forward[c] = _StageForward(forward[c], self._aux, self._kwargs,
                                       _accepted_kwargs(chunks[c]))
        # The same exchange tells every rank which keyword arguments the
        # chunks of the others take (a step's unknown key is a mistake).
        accepts = [_accepted_kwargs(chunks[c]) for c in chunks]
        accepted = None if any(a is None for a in accepts) else sorted(set().union(*accepts))
        everyone = _agree(agree_on, error, at, float(timeout), extra=accepted)
        dp_params: Dict[int, List[torch.Tensor]] = {}
        self._fsdp = fsdp if fsdp else None
        # The first step of a split schedule looks for torch.utils.checkpoint
        # (NOTE [Checkpoint under a split schedule]).
        self._watch_checkpoints = split
        self._loss_groups: List[dist.ProcessGroup] = []
        if self._fsdp is not None:
            dp_params, self._loss_groups = fsdp.split_weights(params, dp_group)
            # Activations are in the unsharded parameters' dtype (FSDP2's param_dtype).
            first = next((q for ps in params.values() for q in ps), None)
        dtype, device, keep_freed_memory = _dtype_and_device(dtype, device, first,
                                                             keep_freed_memory)
        # FSDP2's groups take the loss where they take gradients (NCCL: CUDA).
        self._loss_device = device if device.type == "cuda" else torch.device("cpu")
        shape = _declared_shape(activation_shape)
        # Nothing declared: messages between stages (NOTE [Pytrees between
        # stages]), and every step's arguments checked (NOTE [Arguments of a step]).
        self._messages = shape is None
        # The runtime holds the loss, which must not hold the Pipeline: that
        # cycle through a C++ object is never collected, and the group would
        # live until the interpreter's shutdown (NOTE [A Pipeline's group dies
        # with it] in python/csrc/bind_pipeline.cpp).
        self._loss = _LossOfMicrobatch(loss_fn)
        for f in forward.values():
            f.schedule, f.last_outputs = schedule, self._loss.last_outputs
            f.messages = shape is None  # NOTE [Pytrees between stages]
        self.schedule = schedule
        self._runtime = self._make_runtime(schedule, group, forward, params,
                                           _parameter_names(chunks, params), shape, dtype,
                                           device, timeout, (dp_group, expert_dp_group),
                                           receive_lookahead, p2p,
                                           keep_freed_memory, dp_params, split,
                                           (fb_overlap, defer_wgrad, self.pair_turns, w_parts))
        self.rank = self._runtime.rank
        self._loss.rank = self.rank
        # NOTE [A chunk's own pair]: chunks that define DualPipe's hook run their pairs.
        self._own_pairs = (_ChunkPairs(chunks, forward, self._loss)
                           if all(pair_hook(chunks[c]) is not None for c in chunks) else None)
        self._runtime.set_pair_function(self._own_pairs)
        self._group, self._timeout = group, float(timeout)
        self._broken: Optional[str] = None  # why this rank left a step (NOTE [Arguments of a step])
        self._kw_fp: Optional[int] = None  # the last agreed step's keyword arguments
        self._known_kwargs = self._accepted_by_the_pipeline(accepted, everyone, group)
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
        # NOTE [The deferred W's chosen in the run] in hp/pipeline/pipeline.cpp.
        self._choose_after = 2 if fb_overlap and defer_wgrad == "auto" else None
        self._steps = 0
        # Whether a W may have recomputed (a checkpoint seen, or any recompute
        # since): "auto" then never defers W's into ready turns.
        self._recomputes = _C.recompute.counters().recomputes
        self._checkpoints_seen = False
        #: The share by which deferred W's must shorten the predicted step for
        #: ``defer_wgrad="auto"`` to take them (hp train's 3 %); set it before
        #: the second step, alike on every rank.
        self.defer_wgrad_gain: float = _C.schedule.DEFERRED_W_GAIN
        #: What :meth:`choose_deferred_w` chose last (None before it ran).
        self.deferred_w_choice: Optional[Dict[str, object]] = None

    def _make_runtime(self, schedule, group, forward, params, names, shape, dtype, device, timeout,
                      dp_groups, receive_lookahead, p2p, keep_freed_memory, dp_params, split,
                      overlap):
        """The C++ pipeline (``_C.pipeline.Runtime``) over this rank's stage
        forwards, weights, loss and shapes."""
        options = _C.pipeline.PipelineOptions()
        options.dtype, options.device, options.p2p = dtype, device, p2p
        options.receive_lookahead, options.cache_cpu_memory = receive_lookahead, keep_freed_memory
        options.recompute_sessions = split
        options.fb_overlap, options.defer_wgrad = overlap[0], overlap[1] is True
        options.pair_first_ready = _C.schedule.pair_turns_ready(overlap[2], overlap[1] is True)
        options.deferred_w_parts = overlap[3]
        store_of = dist.distributed_c10d._world.pg_map.get
        dp_group, expert_dp_group = dp_groups
        return _C.pipeline.Runtime(
            schedule,
            group,
            forward,
            params,
            self._loss,
            shape,
            options,
            timeout_s=float(timeout),
            dp_group=dp_group,
            chunk_dp_parameters=dp_params,
            extra_sum=self._aux.take,
            failure_store=store_of(group, (None, None))[1],
            chunk_expert_parameters={c: [q for q in ps if _is_expert(q)] for c, ps in params.items()},
            chunk_parameter_names=names,
            dp_failure_store=None if dp_group is None else store_of(dp_group, (None, None))[1],
            expert_dp_group=expert_dp_group,
            # The step's loss (and auxiliary losses): the mean over FSDP2's
            # data-parallel ranks too, in the C++ step.
            loss_groups=self._loss_groups,
            # FSDP2's controls around the step, called by the C++ step
            # (NOTE [FSDP2 stages]).
            before_step=None if self._fsdp is None else self._fsdp.begin_step,
            after_step=None if self._fsdp is None else self._fsdp.end_step,
        )

    def _accepted_by_the_pipeline(self, mine, everyone, group) -> Optional[frozenset]:
        """The keyword arguments some chunk of the pipeline takes, on any rank
        (None: one takes any): from the composition check's exchange over the
        world (`everyone`, by world rank), else from one over `group`."""
        ranks = _group_ranks(group)
        if group.size() == 1:
            every = [mine]
        elif everyone is not None and ranks[0] >= 0:
            every = [everyone[r] for r in ranks]
        else:
            every = [pickle.loads(b) for b in _all_gather_bytes(
                group, pickle.dumps(mine), self._loss_device, self._timeout,
                f"rank {self.rank}: the Pipeline's exchange of its stages' keyword arguments")]
        return (None if any(e is None for e in every)
                else frozenset().union(*map(frozenset, every)))

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

    def _agree_on_step(self, fingerprint: int, signature, error) -> None:
        """The ranks' agreement before a step (NOTE [Arguments of a step]):
        one all-reduce (MAX) of each rank's keyword-argument fingerprint and
        error flag. Raises on every rank when a rank's arguments were refused
        or the keyword arguments differ."""
        p, me = self._group.size(), self._group.rank()
        flags = torch.full((2 * p,), -1, dtype=torch.int64)
        flags[me], flags[p + me] = fingerprint, 1 if error is not None else 0
        what = ("the check of step()'s arguments (a rank whose keyword arguments changed "
                "from its previous step checks them with the others; did theirs not change?)")
        flags = _allreduce_max(self._group, flags, self._loss_device, self._timeout,
                               f"rank {self.rank}: {what}")
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

    def _gather_text(self, text: str, what: str) -> List[str]:
        return [b.decode() for b in _all_gather_bytes(
            self._group, text.encode(), self._loss_device, self._timeout,
            f"rank {self.rank}: {what}")]

    def register_custom_function(self, kind, fn) -> None:
        """Runs ``fn(pair)`` for each ``FB`` pair of the schedule (dualpipe,
        dualpipev) in place of the built-in order, as torch's
        ``register_custom_function(OVERLAP_F_B, fn)`` does for its runtime.
        ``pair`` says which pair (``action``, e.g. ``"3F1+0B0"``,
        ``forward_stage``, ``forward_microbatch``, ``backward_stage``,
        ``backward_microbatch``) and runs it: ``pair.forward()`` and
        ``pair.backward()`` once each, in any order, or ``pair.overlapped()``
        for both as partners (``fb_overlap``'s runner), or
        ``pair.computed(f)`` where ``f(inputs)`` computes both halves itself
        (what chunks defining DualPipe's ``overlapped_forward_backward`` get:
        NOTE [A chunk's own pair] in chunk_pairs.py). A function that
        returns with a half not run, or runs one twice, fails the step naming
        the pair (NOTE [A pair function] in hp/pipeline/overlap.cpp).
        ``fn=None`` restores the built-in order (the chunks' own
        ``overlapped_forward_backward`` where they define it). ``kind``:
        :data:`OVERLAP_F_B`."""
        if not _is_overlap_kind(kind):
            raise ValueError(f"register_custom_function replaces how FB pairs run: kind must be "
                             f"hyperparallel.pipeline.OVERLAP_F_B, got {kind!r}")
        if fn is not None and not callable(fn):
            raise TypeError(f"register_custom_function needs a callable fn(pair) or None, "
                            f"got {type(fn).__name__}")
        self._runtime.set_pair_function(self._own_pairs if fn is None else fn)

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
        the step's timings (``compute``, ``comm_wait``, ``chunk_wait``: waits
        inside the stages, as an expert layer's all-to-alls, with nothing
        else to compute, ``overhead``), ``aux_loss`` (NOTE [Auxiliary losses]) and, with
        ``fb_overlap``, ``pairs``, ``pair_hidden``, ``pair_exposed`` and
        ``pair_exposed_alone`` (the overlapped pairs and their waits' seconds
        hidden, exposed, and exposed after the other half ended)."""
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
        except Exception as e:  # noqa: BLE001 - raised below, after the peers are told
            error = e
        # The agreement: on every step where nothing is declared; with a
        # declared shape on the first step, and on a later one whose keyword
        # arguments changed on this rank (a rank whose own checks failed then
        # tells its peers by abandoning instead: they may already wait in the
        # step).
        if self._group.size() > 1 and (self._messages or self._kw_fp is None or (
                error is None and fingerprint != self._kw_fp)):
            self._agree_on_step(fingerprint, signature, error)
        elif error is not None:
            if self._group.size() > 1:
                # The peers may already wait in this step for this rank.
                why = f"rank {self.rank}'s step() refused its arguments: {error}"
                self._broken = why
                self._runtime.abandon(why)
            raise error
        self._kw_fp = fingerprint
        self._kwargs.per_microbatch, self._kwargs.constant = per_mb, constant
        self._loss.targets = tgts
        counter = _CheckpointCounter() if self._watch_checkpoints else None
        try:
            with contextlib.ExitStack() as scope:
                if counter is not None:
                    scope.enter_context(counter)
                if self._step_context is not None:
                    scope.enter_context(self._step_context())
                stats = self._runtime.step(ins)
        finally:
            self._loss.targets = []
            self._kwargs.per_microbatch, self._kwargs.constant = [], {}
            self._loss.last_outputs.clear()
        if counter is not None:
            self._watch_checkpoints = False
            self._checkpoints_seen = counter.count > 0
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
        # NOTE [Auxiliary losses]: their mean over microbatches, every rank's.
        stats["aux_loss"] = stats.pop("extra")
        self.last_stats = stats
        self._steps += 1
        if self._steps == self._choose_after:
            self.choose_deferred_w(self.defer_wgrad_gain)
        return stats["loss"]

    def choose_deferred_w(self, gain: Optional[float] = None) -> Dict[str, object]:
        """Whether the ``FB`` pairs' weight gradients defer from the next step
        (``defer_wgrad``), decided from the last step: rank 0 of the group
        fits the stage costs to every rank's events of that step and
        simulates the schedule with and without deferred W's (NOTE [The
        deferred W's chosen in the run] in hp/pipeline/pipeline.cpp). On
        when the predicted step is ``gain`` (default
        :attr:`defer_wgrad_gain`) shorter; a choice of "on" is applied and
        stays. Collective: every rank of the group and of ``dp_group`` calls
        it after the same step, and all take rank 0's answer (``dp_group``'s
        rank 0's). ``defer_wgrad="auto"`` calls it after the second step.
        Returns (and keeps as :attr:`deferred_w_choice`) ``defer``, the
        predicted steps ``step_with`` and ``step_without`` in seconds and the
        predicted peak activations ``peak_with`` and ``peak_without`` (in
        microbatches' worth); nothing is simulated (``defer`` False,
        ``step_with`` 0) without ``fb_overlap``, without ``FB`` pairs, or
        where the W's defer already."""
        if gain is None:
            gain = self.defer_wgrad_gain
        if isinstance(gain, bool) or not isinstance(gain, (int, float)):
            raise TypeError(f"gain must be a number, got {type(gain).__name__}")
        if self._broken is not None:
            raise RuntimeError(
                f"a previous step failed on this rank ({self._broken}): make a new Pipeline")
        if self._steps == 0:
            raise RuntimeError("choose_deferred_w fits its costs to the last step: run one first")
        try:
            recomputes = (self._checkpoints_seen
                          or _C.recompute.counters().recomputes > self._recomputes)
            choice = self._runtime.choose_deferred_w(float(gain), self.pair_turns, recomputes)
        except ValueError:  # the gain, refused before any communication
            raise
        except Exception as e:  # a collective failed: the peers' state is unknown
            self._broken = f"choose_deferred_w failed: {e}"
            raise
        choice["after_step"] = self._steps
        self.deferred_w_choice = choice
        return choice
