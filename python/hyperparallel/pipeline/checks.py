"""What a Pipeline checks before it runs, and how its ranks agree on it:
its arguments one by one (_check_arguments), the collectives of the Python side with the Pipeline's timeout (_wait,
_allreduce_max, _all_gather_bytes), the agreement on a rank's refusal
(_agree, NOTE [Ranks agree on their compositions]), and the compositions
checked: placement, expert parallelism, torch.compile'd stages and
torch.utils.checkpoint under a split schedule."""

from __future__ import annotations

import datetime
import math
import pickle
import warnings
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .chunk_pairs import pair_hook
from .helpers import PipelineSchedule


def _group_ranks(group) -> Tuple[int, ...]:
    """The global ranks of `group`; a group that torch.distributed did not
    register (made directly from a store) is known by its size only."""
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError):
        return (-1 - group.size(),)


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
def _agree(groups, error: Optional[str], device: torch.device, timeout: float,
           extra=None) -> Optional[list]:
    """Raises on every rank when any rank has an `error`, or when a rank uses
    a group (`groups`: [(what it is for, group)], the pipeline's group first)
    that one of its members does not (NOTE [Ranks agree on their
    compositions]). Over torch.distributed's world, the same exchange carries
    `extra` (anything picklable): returns every world rank's, by rank; None
    where the ranks met over their groups instead."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        me = dist.get_rank()
        listed = []
        for what, g in groups:
            if g is not None and g.size() > 1 and (what, _group_ranks(g)) not in listed:
                listed.append((what, _group_ranks(g)))
        try:
            got = _all_gather_bytes(dist.group.WORLD, pickle.dumps((error, listed, extra)),
                                    device, timeout, "the Pipeline's check of its compositions")
        except RuntimeError as e:
            raise RuntimeError(
                f"rank {me}: the ranks of torch.distributed's world did not all reach the "
                f"Pipeline's check of its compositions within {timeout} s (timeout=): every "
                "rank builds its Pipeline at the same point of its script; did a rank fail "
                f"before building its Pipeline? ({e})") from e
        views = [pickle.loads(b) for b in got]
        if error:
            raise ValueError(error)
        for r, (err, _, _) in enumerate(views):
            if err:
                raise ValueError(f"rank {r} refused this Pipeline: {err} (every rank stops "
                                 "with it, before the first step)")
        for r, (_, used, _) in enumerate(views):
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
        return [x for _, _, x in views]
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
        return None
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
    return None


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


def _expert_parallel_check(params: Dict[int, List[torch.Tensor]], dp_group,
                           expert_dp_group=None) -> Optional[str]:
    """Why this rank's expert-parallel chunks cannot train with `dp_group`
    (and `expert_dp_group`: NOTE [Expert gradients] in
    hp/pipeline/pipeline.cpp), or None."""
    groups = {getattr(q, "_hp_expert_group") for ps in params.values() for q in ps if _is_expert(q)}
    if not groups or groups == {(0,)}:
        if expert_dp_group is not None:
            return ("expert_dp_group was given but this rank's chunks hold no experts sharded "
                    "by hyperparallel.moe.expert_parallel: drop expert_dp_group")
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
    if expert_dp_group is None:
        if tuple(sorted(dp_ranks)) != tuple(sorted(ep_ranks)):
            return (f"dp_group has ranks {list(dp_ranks)} but the experts are spread over ranks "
                    f"{list(ep_ranks)}: give the expert-parallel group as dp_group, or, where "
                    "the experts are replicated over a larger dp_group, expert_dp_group=<the "
                    "ranks of dp_group holding this rank's experts>")
        return None
    edp_ranks = tuple(_group_ranks(expert_dp_group))
    me = dist.get_rank() if dist.is_initialized() else -1
    if (not set(ep_ranks) <= set(dp_ranks) or not set(edp_ranks) <= set(dp_ranks)
            or set(ep_ranks) & set(edp_ranks) != {me}
            or len(ep_ranks) * len(edp_ranks) != len(dp_ranks)):
        return (f"expert_dp_group has ranks {list(edp_ranks)}, the experts are spread over "
                f"ranks {list(ep_ranks)} and dp_group has ranks {list(dp_ranks)}: dp_group must "
                "be tiled by the expert-parallel groups, with expert_dp_group holding one rank "
                "of each (this rank in its own), e.g. the 'ep' and 'edp' dimensions of "
                "init_device_mesh(..., (dp // ep, ep), mesh_dim_names=('edp', 'ep'))")
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


def _composition_error(fsdp, schedule, chunks, params, parameters, group,
                       dp_group, expert_dp_group=None) -> Optional[str]:
    """Why this rank's chunks cannot make this pipeline, or None: FSDP2's
    checks, then expert parallelism's, the
    placement of parameters and groups (NOTE [Ranks agree on their
    compositions] makes every rank stop with it)."""
    error = None
    if fsdp:
        error = fsdp.pipeline_error(schedule, group, dp_group, params, parameters)
    if error is None:
        error = _expert_parallel_check(params, dp_group, expert_dp_group)
    if error is None:
        error = _placement_check(chunks, params, group, dp_group)
    if error is None:
        error = _tied_check(chunks)
    return error


def _tied_check(chunks) -> Optional[str]:
    """A parameter split_model found shared by chunks (tied weights) that
    is no longer one of its chunk's parameters: replaced in one holder
    (fully_shard on a module holding it), the copies would train apart."""
    for c, mod in chunks.items():
        shared = getattr(mod, "shared_parameters", None)
        if not shared:
            continue
        have = {id(q) for q in mod.parameters()}
        lost = sorted(n for n, q in getattr(mod, "_shared_objects", {}).items() if id(q) not in have)
        if lost:
            return (f"chunk {c}: {lost[0]}, which split_model found shared by chunks "
                    f"{list(shared[lost[0]])} (tied weights), is no longer one of its "
                    "parameters: something replaced it in one of its holders (fully_shard on a "
                    "module that holds a tied weight does), and the copies would train apart. "
                    "Leave the modules that hold it unsharded (dp_group averages them)")
    return None


def _groups_to_agree_on(group, dp_group, fsdp, params, expert_dp_group=None) -> list:
    """[(what it is for, group)]: the groups this rank's Pipeline uses, the
    pipeline's group first (what _agree compares across the ranks)."""
    agree_on = [("the pipeline's group", group), ("dp_group", dp_group),
                ("expert_dp_group", expert_dp_group)]
    for c, groups in fsdp.chunk_groups.items():
        agree_on.extend((f"FSDP2's mesh of chunk {c}", g)
                        for pg in groups for g in fsdp.mesh_groups(pg))
    for c, ps in params.items():
        for q in ps:
            mesh = getattr(q, "device_mesh", None)
            if mesh is not None:
                agree_on.extend((f"the DTensor mesh of chunk {c}'s parameters",
                                 mesh.get_group(d)) for d in range(mesh.ndim))
    return agree_on


def _compiled_step_context(chunks, split):
    """What every step of a split schedule runs in when chunks are
    torch.compile'd (donated buffers off, after one RuntimeWarning: NOTE
    [Compiled stages under a split schedule]), else None."""
    compiled = sorted(c for c, fn in chunks.items() if _is_compiled(fn))
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
            stacklevel=3,  # the caller of Pipeline()
        )
    # The whole step, forwards and backwards: AOTAutograd compiles a
    # region's backward lazily, at its first run.
    return _without_donated_buffers if split and compiled else None


def _check_arguments(chunks, schedule, loss_fn, receive_lookahead, p2p, overlap, timeout,
                     dtype, group, dp_group, expert_dp_group) -> dist.ProcessGroup:
    """Pipeline's arguments checked, one by one in this order (a TypeError or
    ValueError naming the first wrong one); the pipeline's group (the
    world's when None)."""
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
    fb_overlap, defer_wgrad, pair_turns, w_parts = overlap
    if not isinstance(fb_overlap, bool):
        raise TypeError(f"fb_overlap must be a bool, got {type(fb_overlap).__name__}")
    if not isinstance(defer_wgrad, bool) and defer_wgrad != "auto":
        raise TypeError(f"defer_wgrad must be True, False or 'auto', got {defer_wgrad!r}")
    if defer_wgrad is True and not fb_overlap:
        raise ValueError("defer_wgrad=True queues the weight gradients of overlapped pairs: "
                         "it needs fb_overlap=True")
    if not isinstance(pair_turns, str):
        raise TypeError(f"pair_turns must be a str, got {type(pair_turns).__name__}")
    if pair_turns not in ("auto", "ready", "fixed"):
        raise ValueError(f"pair_turns must be 'auto', 'ready' or 'fixed', got {pair_turns!r}")
    if pair_turns != "fixed" and not fb_overlap:
        raise ValueError(f"pair_turns={pair_turns!r} orders the halves of overlapped pairs: "
                         "it needs fb_overlap=True")
    if isinstance(w_parts, bool) or not isinstance(w_parts, int):
        raise TypeError(f"w_parts must be an int, got {type(w_parts).__name__}")
    if w_parts < 1:
        raise ValueError(f"w_parts must be 1 or more, got {w_parts}")
    if w_parts > 1 and not (defer_wgrad is True and pair_turns == "ready"):
        raise ValueError("w_parts cuts the deferred W's that fill the waits of ready turns: it "
                         "needs defer_wgrad=True and pair_turns='ready'")
    if isinstance(chunks, Mapping):
        hooked = sorted(c for c in chunks if pair_hook(chunks[c]) is not None)
        if hooked and len(hooked) != len(chunks):
            raise ValueError(
                f"chunks {hooked} define overlapped_forward_backward and chunks "
                f"{sorted(set(chunks) - set(hooked))} do not: a pair may join any two chunks, "
                "so all of this rank's chunks define it or none")
        if hooked and fb_overlap:
            raise ValueError(
                "fb_overlap=True runs the FB pairs with the built-in overlapped runner, and the "
                "chunks define overlapped_forward_backward, which runs them itself: pick one "
                "(NOTE [A chunk's own pair] in hyperparallel/pipeline/chunk_pairs.py)")
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
    for name, g in (("dp_group", dp_group), ("expert_dp_group", expert_dp_group)):
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"{name} must be None or a torch.distributed.ProcessGroup, got {type(g)}")
    return group


# NOTE [Ready turns from Python]
# Ready turns (NOTE [Turns as messages arrive] in hp/pipeline/overlap.cpp)
# let a pair's halves post by timing, which is safe only where every
# exchange a half makes goes to a lane of its own: the pipeline's transfers
# keep their order, hyperparallel.moe's dispatchers over Gloo are made in
# lanes (python/csrc/bind_moe.cpp) and the Pipeline puts dp_group in lanes.
# FSDP2's gathers and reductions and DTensor's collectives (tensor
# parallelism) go to torch's own groups, which have none, and on a device
# the halves' waits only order their streams. There "auto" takes fixed
# turns and "ready" is refused. A chunk's own torch.distributed calls cannot
# be seen: with them, keep "fixed" (the default).
def _resolve_pair_turns(pair_turns: str, device: torch.device, fsdp,
                        params) -> Tuple[str, Optional[str]]:
    """The turns the pairs take: `pair_turns`, or "fixed" where ready turns
    cannot be (NOTE [Ready turns from Python]); and why "ready" is refused
    there (None where it is not)."""
    if pair_turns == "fixed":
        return pair_turns, None
    why = None
    if device.type != "cpu":
        why = f"the ranks compute on {device.type}, where each half has a stream of its own"
    elif fsdp:
        why = "FSDP2 stages gather and reduce their weights over torch's groups inside the halves"
    else:
        from torch.distributed.tensor import DTensor

        if any(isinstance(q, DTensor) for ps in params.values() for q in ps):
            why = "DTensor parameters exchange over torch's groups inside the halves"
    if why is None:
        return pair_turns, None
    if pair_turns == "ready":
        return "fixed", (
            f"pair_turns='ready' lets a pair's halves post as their messages arrive, which needs "
            f"every exchange of a half on a lane of its own: {why}; use 'fixed' or 'auto' "
            "(NOTE [Ready turns from Python] in hyperparallel/pipeline/checks.py)")
    return "fixed", None
