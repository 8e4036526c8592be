"""FSDP2 (``fully_shard``) modules inside a rank's chunks: found, checked
against the pipeline, and controlled around each step (_Fsdp2Stages, NOTE
[FSDP2 stages])."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .checks import _group_ranks


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
#  - The C++ step calls begin_step before its first action and end_step
#    after its last (PipelineOptions::before_step / after_step in
#    hp/pipeline/pipeline.h), end_step(False) when the step failed.
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

    def pipeline_error(self, schedule, group, dp_group, params, parameters) -> Optional[str]:
        """What is wrong with these FSDP2 modules in this rank's pipeline
        (check(), parameters that dp_group would reduce too, FSDP2's own
        initialization: root_check()), or None."""
        holders: Dict[int, set] = {}
        for st, c in enumerate(schedule.stage_chunk):
            holders.setdefault(c, set()).add(schedule.stage_rank[st])
        replicated = {c for c, h in holders.items() if len(h) > 1}
        dp_ranks = _group_ranks(dp_group) if dp_group is not None else None
        error = self.check(group.rank(), _group_ranks(group), dp_ranks, replicated)
        if error is None and dp_group is not None:
            for c in self.chunk_groups:
                managed = self.managed(c)
                if parameters is not None and c in parameters and any(
                    id(q) in managed for q in parameters[c]
                ):
                    error = (f"chunk {c}: parameters[{c}] lists parameters that FSDP2 "
                             "manages (fully_shard), and dp_group was given: both would "
                             "reduce the same gradients; leave FSDP2's parameters out of "
                             "parameters= (the runtime finds them)")
            if error is None and all(
                all(id(q) in self.managed(c) for q in params[c]) for c in params
            ):
                mesh = sorted(self.data_parallel_ranks(self.groups[0]))
                error = ("dp_group was given, but FSDP2 (fully_shard) manages every "
                         f"parameter of this rank's chunks {sorted(params)} and already "
                         f"averages their gradients over ranks {mesh}: dp_group and FSDP2 "
                         "would reduce the same parameters. Drop dp_group (the step's loss "
                         "is averaged over FSDP2's ranks), or keep it for parameters "
                         "FSDP2 does not manage")
        if error is None:
            try:  # FSDP2's own checks raise here; every rank must still agree
                error = self.root_check()
            except Exception as e:  # noqa: BLE001 - reported through _agree
                error = f"FSDP2's initialization of this rank's chunks failed: {e!r}"
        return error

    def split_weights(self, params, dp_group):
        """After the ranks agreed: the split's weights, in `params` (changed in
        place: FSDP2's unsharded parameters for the sharded ones, and every
        parameter FSDP2 reduces), ``{chunk: plain parameters}`` for dp_group,
        and FSDP2's groups that the step's loss is averaged over."""
        dp_params: Dict[int, List[torch.Tensor]] = {}
        loss_groups = []
        unsharded = self.unsharded_parameters()
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
        for pg in self.groups:
            for g in self.mesh_groups(pg):
                ranks = _group_ranks(g)
                if ranks in seen_groups or g.size() < 2:
                    continue
                seen_groups.add(ranks)
                if dp_ranks is None or set(dp_ranks) != self.data_parallel_ranks(pg):
                    loss_groups.append(g)
        return dp_params, loss_groups

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
