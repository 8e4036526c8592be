"""GraphTrainer: compile on the first batch, replay under torch.no_grad(),
accumulate gradients by FQN, step an optimizer built on the shards
(seed 002 §5, §10)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .mesh import MeshContext, register_process_group
from .parallel_config import PassConfig
from .passes.fsdp import planned_parameters
from .passes.pipeline import PassPipeline
from .tracer import check_leaf_types, input_signature, trace_model_graph

__all__ = ["GraphTrainer", "default_device"]


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Compiled:
    def __init__(self, gm, runner):
        self.gm = gm
        self.runner = runner


class GraphTrainer:
    """Trains `model` with `train_fn(model, input, label) -> loss` captured as
    one joint graph and transformed by PassPipeline.from_config(pass_config,
    pass_plan).

    optimizer_config: None or a dict: "lr" (1e-3), "grad_clip" (None: no
    clipping; else the global gradient norm is clipped to it, over the FSDP
    shards), "optimizer" (a torch.optim.Optimizer class, or a callable
    params -> optimizer; default torch.optim.Adam with foreach=False, the
    seed's minimal Adam), any other key is passed to the optimizer class.
    """

    def __init__(self, model: torch.nn.Module, train_fn: Callable,
                 pass_config: Optional[PassConfig] = None, pass_plan=None,
                 optimizer_config: Optional[Dict[str, Any]] = None, device=None,
                 mesh_context: Optional[MeshContext] = None, tracing_mode: str = "fake"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"GraphTrainer: model must be a torch.nn.Module, not "
                            f"{type(model).__name__}")
        if not callable(train_fn):
            raise TypeError("GraphTrainer: train_fn must be callable as "
                            "train_fn(model, input, label) -> loss")
        self.model = model
        self.train_fn = train_fn
        self.pass_config = pass_config if pass_config is not None else PassConfig()
        self.pass_config.validate()
        self.pass_plan = pass_plan
        self.optimizer_config = dict(optimizer_config or {})
        self.mesh_context = mesh_context
        self.tracing_mode = tracing_mode
        self.device = torch.device(device) if device is not None else default_device()
        self.model.to(self.device)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.fsdp_degree = 1
        self._fsdp_group = None
        self._compiled: Dict[Any, _Compiled] = {}
        self._pytree_pre_hook: Optional[Callable[[], None]] = None
        self._hook_ran = False
        self._check_plan()
        if mesh_context is not None:
            mesh_context.validate()
        self._check_optimizer_config()

    # -- extension points ------------------------------------------------
    def set_pytree_pre_hook(self, hook: Callable[[], None]) -> "GraphTrainer":
        """`hook()` runs once before the first compile: register model-specific
        pytree nodes there (torch.utils._pytree.register_pytree_node)."""
        self._pytree_pre_hook = hook
        return self

    def to(self, device) -> "GraphTrainer":
        """Moves the model (and later batches) to `device`; compiled graphs are
        dropped (they are specialised on the device)."""
        self.device = torch.device(device)
        self.model.to(self.device)
        self._compiled.clear()
        return self

    @property
    def graph_module(self):
        """The last compiled GraphModule (None before the first compile)."""
        return next(reversed(self._compiled.values())).gm if self._compiled else None

    @property
    def graph_modules(self) -> List[Any]:
        return [c.gm for c in self._compiled.values()]

    # -- checks before capture -------------------------------------------
    def _check_plan(self) -> None:
        plan = self.pass_plan
        if plan is None:
            return
        modules = {name for name, _ in self.model.named_modules() if name}
        params = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        for fqn in plan.fsdp_modules:
            if fqn not in modules and fqn not in params:
                raise ValueError(f"PassPlan: module '{fqn}' does not exist in the model "
                                 f"{type(self.model).__name__} (its modules: "
                                 f"{', '.join(sorted(modules)[:20]) or 'none'})")
        for pattern in plan.fsdp_patterns:
            if not any(_fnmatch(m, pattern) for m in modules | params):
                raise ValueError(f"PassPlan: pattern '{pattern}' matches no module of the "
                                 f"model {type(self.model).__name__}")

    def _check_optimizer_config(self) -> None:
        clip = self.optimizer_config.get("grad_clip")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise ValueError(f"GraphTrainer: optimizer_config grad_clip is {clip!r}; give a "
                             "positive number or None")
        if clip is not None and self.mesh_context is not None and self.mesh_context.tp_size() > 1:
            raise ValueError("GraphTrainer: grad_clip on a mesh with TP (tp > 1) is not "
                             "supported: the trainer does not know which parameters TP shards")

    def _resolve_fsdp(self) -> None:
        """Decides the FSDP group (registered as "fsdp") and degree."""
        cfg = self.pass_config
        self._fsdp_group, self.fsdp_degree = None, 1
        if not cfg.fsdp_enabled or not (dist.is_available() and dist.is_initialized()):
            return
        if self.mesh_context is not None:
            group = self.mesh_context.fsdp_group()
            degree = self.mesh_context.fsdp_degree()
            dim = self.mesh_context.fsdp_dim_name()
            if cfg.fsdp_degree is not None and cfg.fsdp_degree != degree:
                raise ValueError(f"GraphTrainer: PassConfig.fsdp_degree is {cfg.fsdp_degree} but "
                                 f"the mesh's FSDP dimension '{dim}' has {degree} ranks")
            tp = self.mesh_context.tp_size()
            if cfg.tp_size != 1 and cfg.tp_size != tp:
                raise ValueError(f"GraphTrainer: PassConfig.tp_size is {cfg.tp_size} but the "
                                 f"mesh's TP dimension has {tp} ranks")
            cfg.tp_size = tp
        else:
            group = dist.group.WORLD
            degree = dist.get_world_size()
            if cfg.fsdp_degree is not None and cfg.fsdp_degree != degree:
                raise ValueError(f"GraphTrainer: PassConfig.fsdp_degree is {cfg.fsdp_degree} but "
                                 f"the world has {degree} ranks; give a MeshContext to shard "
                                 "over a sub-group")
        cfg.fsdp_degree = degree
        register_process_group("fsdp", group)
        self._fsdp_group, self.fsdp_degree = group, degree

    # -- compile ----------------------------------------------------------
    def compile(self, sample_input: Any, sample_label: Any) -> torch.fx.GraphModule:
        """Captures and transforms the graph for this input signature (done by
        train_step on the first batch of each new signature)."""
        self._run_pre_hook()
        key = input_signature(sample_input, sample_label)
        if key in self._compiled:
            return self._compiled[key].gm
        if not self._compiled:
            self._resolve_fsdp()
            self._agree_across_ranks()
        full_shapes = self.model.__dict__.get("_hp_fsdp_full_shapes", {})
        if self.fsdp_degree > 1:  # errors before capture
            planned_parameters(self.model, self.pass_plan, self.fsdp_degree, full_shapes)
        overrides = {fqn: torch.empty(shape, dtype=self.model.get_parameter(fqn).dtype,
                                      device=self.device)
                     for fqn, (shape, _) in full_shapes.items()}
        gm = trace_model_graph(self.model, self.train_fn, sample_input, sample_label,
                               tracing_mode=self.tracing_mode, state_overrides=overrides)
        pipeline = PassPipeline.from_config(self.pass_config, self.pass_plan)
        gm = pipeline.run(gm, model=self.model, fsdp_group_name="fsdp")
        self._compiled[key] = _Compiled(gm, pipeline.compile(gm))
        if self.optimizer is None:
            self.optimizer = self._init_optimizer()
        return gm

    # NOTE [Graph-mode ranks agree before they capture]
    # The FSDP pass shards by the plan and the parameters' shapes, and every
    # collective of the graph is sized by them. Ranks given different plans,
    # configurations or models (another width) captured different graphs and
    # met in a collective of mismatched sizes: Gloo aborted the process
    # (exit -6) with no word of why. So at the first compile the ranks of the
    # FSDP group gather a fingerprint of each of the three and every rank
    # raises the same ValueError, naming the rank and what differs, before
    # any capture.
    def _agree_across_ranks(self) -> None:
        group = self._fsdp_group
        if group is None or self.fsdp_degree <= 1:
            return
        import hashlib

        plan = self.pass_plan
        parts = {
            "PassPlan": repr(None if plan is None else (
                sorted(plan.fsdp_modules), sorted(plan.fsdp_patterns), plan.enabled)),
            # a backend given as a callable: by name (its repr holds an address)
            "PassConfig": repr(sorted(
                (k, getattr(v, "__qualname__", repr(v)) if callable(v) else repr(v))
                for k, v in vars(self.pass_config).items() if k != "fsdp_degree")),
            "model's parameters (names, shapes, dtypes)": repr(
                [(n, tuple(p.shape), str(p.dtype))
                 for n, p in self.model.named_parameters(remove_duplicate=False)]),
        }
        mine = torch.tensor([int.from_bytes(hashlib.sha256(v.encode()).digest()[:7], "little")
                             for v in parts.values()], dtype=torch.int64)
        on = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
        every = [torch.empty_like(mine, device=on) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine.to(on), group=group)
        me = dist.get_rank(group)
        for q, theirs in enumerate(every):
            for what, a, b in zip(parts, theirs.cpu().tolist(), mine.tolist()):
                if a != b:
                    raise ValueError(
                        f"GraphTrainer: rank {q} of the FSDP group was given another {what} "
                        f"than rank {me}: every rank of the group must be given the same "
                        "PassPlan, PassConfig and model (NOTE [Graph-mode ranks agree before "
                        "they capture])")

    def _run_pre_hook(self) -> None:
        if self._pytree_pre_hook is not None and not self._hook_ran:
            self._pytree_pre_hook()
            self._hook_ran = True

    def _init_optimizer(self) -> torch.optim.Optimizer:
        cfg = dict(self.optimizer_config)
        cfg.pop("grad_clip", None)
        make = cfg.pop("optimizer", None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if make is None:
            cfg.setdefault("lr", 1e-3)
            cfg.setdefault("foreach", False)
            return torch.optim.Adam(params, **cfg)
        if isinstance(make, type) and issubclass(make, torch.optim.Optimizer):
            cfg.setdefault("lr", 1e-3)
            return make(params, **cfg)
        if callable(make):
            opt = make(params)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"GraphTrainer: optimizer_config optimizer returned a "
                                f"{type(opt).__name__}, not a torch.optim.Optimizer")
            held = {id(q) for g in opt.param_groups for q in g["params"]}
            if params and not any(id(q) in held for q in params):
                raise ValueError(
                    f"GraphTrainer: the optimizer that optimizer_config's optimizer made holds "
                    f"none of the model's {len(params)} trainable parameters, so training would "
                    "never move them: build it from the parameters it is given "
                    "(optimizer=lambda params: torch.optim.SGD(params, lr=...))")
            return opt
        raise ValueError(f"GraphTrainer: optimizer_config optimizer is {make!r}; give a "
                         "torch.optim.Optimizer class or a callable params -> optimizer")

    # -- steps ------------------------------------------------------------
    def _to_device(self, tree):
        return pytree.tree_map(
            lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, tree)

    def train_step(self, input: Any, label: Any) -> torch.Tensor:
        """One forward + backward by graph replay; gradients are added into the
        live parameters' .grad by FQN. Returns the (local) loss."""
        self._run_pre_hook()
        input, label = self._to_device(input), self._to_device(label)
        key = input_signature(input, label)
        if key not in self._compiled:
            self.compile(input, label)
        compiled = self._compiled[key]
        gm = compiled.gm
        leaves, _ = check_leaf_types((input, label), "(input, label)")
        state = [self.model.get_parameter(f) if is_p else self.model.get_buffer(f)
                 for f, is_p in zip(gm.state_fqns, gm.state_is_param)]
        args = state + [t for t in leaves if isinstance(t, torch.Tensor)]
        with torch.no_grad():
            outs = compiled.runner(*args)
        self._accumulate_grads(gm.grad_fqns, list(outs[1:]))
        return outs[0].detach()

    def _accumulate_grads(self, fqns: List[str], grads: List[torch.Tensor]) -> None:
        live = {}
        for fqn, p in self.model.named_parameters():
            if p.requires_grad:
                live[fqn] = p
        if len(grads) != len(fqns) or len(fqns) != len(live):
            raise RuntimeError(
                f"GraphTrainer: the graph gives {len(grads)} gradients for {len(fqns)} parameter "
                f"FQNs but the model has {len(live)} trainable parameters; refusing to assign "
                "(was a parameter added, removed or frozen after compile?)")
        with torch.no_grad():
            for fqn, g in zip(fqns, grads):
                p = live.get(fqn)
                if p is None:
                    raise RuntimeError(f"GraphTrainer: the graph's gradient '{fqn}' names no "
                                       "trainable parameter of the model")
                if g.shape != p.shape:
                    raise RuntimeError(f"GraphTrainer: gradient of '{fqn}' has shape "
                                       f"{tuple(g.shape)}, the parameter {tuple(p.shape)}")
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scales the gradients so their global norm (over the FSDP shards) is
        at most max_norm; returns the norm before clipping."""
        sharded = set(getattr(self.graph_module, "fsdp_fqns", ())) if self._compiled else set()
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for fqn, p in self.model.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            sq = p.grad.detach().double().pow(2).sum()
            if fqn in sharded:
                local += sq
            else:
                replicated += sq
        if sharded and self._fsdp_group is not None:
            dist.all_reduce(local, group=self._fsdp_group)
        norm = math.sqrt((local + replicated).item())
        scale = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if scale < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(scale)
        return norm

    def optimizer_step(self) -> None:
        """Clips (optimizer_config grad_clip), steps, and clears the gradients."""
        if self.optimizer is None:
            raise RuntimeError("GraphTrainer: optimizer_step before the first train_step")
        clip = self.optimizer_config.get("grad_clip")
        if clip is not None:
            self.clip_grad_norm_(clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, dataloader: Iterable, max_steps: Optional[int] = None,
              log_interval: Optional[int] = None,
              log_fn: Optional[Callable[[int, float], None]] = None) -> List[float]:
        """For each (input, label) of `dataloader` (at most max_steps):
        train_step then optimizer_step. Every log_interval steps log_fn(step,
        loss) is called (default: print on rank 0). Returns the losses."""
        losses: List[float] = []
        for step, batch in enumerate(dataloader):
            if max_steps is not None and step >= max_steps:
                break
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError("GraphTrainer.train: each batch must be a pair (input, label), "
                                f"not {type(batch).__name__}")
            loss = self.train_step(*batch)
            self.optimizer_step()
            losses.append(loss.item())
            if log_interval and (step + 1) % log_interval == 0:
                (log_fn or _print_rank0)(step + 1, losses[-1])
        return losses


def _print_rank0(step: int, loss: float) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"step {step} loss {loss:.6f}", flush=True)


def _fnmatch(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)
