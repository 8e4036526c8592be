"""Graph mode with FSDP on two real processes (Gloo, float64): training
equals single-process eager training (losses and parameters to 1e-9) with
overlap, without it, with reshard-after-forward, on a DeviceMesh's "dp"
dimension, and across a recompile for a new batch shape; TP on a mesh's
"tp" dimension (the model's own TP collectives captured into the graph);
and tp = 2 x dp = 2 on four processes, FSDP over the mesh's dp dimension. Run as a script,
this file is one rank (torchrun's variables)."""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
STEPS = 4


class Net(torch.nn.Module):
    """fc1 and blocks.* are planned (sharded); head (3 rows: 2 does not
    divide them) stays replicated and is all-reduced."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        for b in self.blocks:
            h = h + torch.relu(b(h))
        return self.head(self.norm(h))


def train_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=g))


def rows_of(step, recompile=False):
    return 12 if recompile and step == STEPS - 1 else 8  # a new shape: a second graph


def eager(opt_cfg, recompile):
    model = Net()
    cls = opt_cfg.get("optimizer", torch.optim.Adam)
    opt = cls(model.parameters(), lr=opt_cfg["lr"], **({"foreach": False}
                                                       if cls is torch.optim.Adam else {}))
    losses = []
    for s in range(STEPS):
        x, y = batch(s, rows_of(s, recompile))
        opt.zero_grad()
        loss = train_fn(model, x, y)
        loss.backward()
        if opt_cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg["grad_clip"])
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(g, "sum", ctx.group)), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPNet(torch.nn.Module):
    """Net's fc1 -> tanh -> head, fc1 column-parallel and head row-parallel
    over the mesh's TP group (the model's own collectives, captured into the
    graph); tp_rank's slices of the full model's parameters."""

    def __init__(self, group, tp_rank, tp_size):
        super().__init__()
        full = Net()
        self.group = group
        rows = slice(tp_rank * 8 // tp_size, (tp_rank + 1) * 8 // tp_size)
        self.fc1 = torch.nn.Linear(6, 8 // tp_size).double()
        self.head = torch.nn.Linear(8 // tp_size, 3).double()
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rows])
            self.fc1.bias.copy_(full.fc1.bias[rows])
            self.head.weight.copy_(full.head.weight[:, rows])
            self.head.bias.copy_(full.head.bias)

    def forward(self, x):
        h = torch.tanh(self.fc1(_CopyToTP.apply(x, self.group)))
        out = _ReduceFromTP.apply(torch.nn.functional.linear(h, self.head.weight), self.group)
        return out + self.head.bias


def eager_tp_reference(lr):
    full = Net()
    model = torch.nn.ModuleDict({"fc1": full.fc1, "head": full.head})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for s in range(STEPS):
        x, y = batch(s, rows_of(s))
        opt.zero_grad()
        loss = train_fn(lambda v: model["head"](torch.tanh(model["fc1"](v))), x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def tp_case(world, rank):
    """tp = world x dp = 1: the TP group from the mesh, FSDP off by degree 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from hyperparallel.compile import GraphTrainer, MeshContext, PassConfig

    ctx = MeshContext(init_device_mesh("cpu", (world, 1), mesh_dim_names=("tp", "dp")))
    model = TPNet(ctx.tp_group(), rank, world)
    trainer = GraphTrainer(model, train_fn, PassConfig(), None,
                           {"lr": 0.1, "optimizer": torch.optim.SGD}, device="cpu",
                           mesh_context=ctx)
    losses = []
    for s in range(STEPS):
        x, y = batch(s, rows_of(s))
        losses.append(trainer.train_step(x, y).item())  # every TP rank sees the whole batch
        trainer.optimizer_step()
    ref_losses, ref = eager_tp_reference(0.1)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    want = {"fc1.weight": ref["fc1.weight"][rows], "fc1.bias": ref["fc1.bias"][rows],
            "head.weight": ref["head.weight"][:, rows], "head.bias": ref["head.bias"]}
    gm = trainer.graph_module
    return {
        "loss_err": max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses)),
        "param_err": max((p.detach() - want[n]).abs().max().item()
                         for n, p in model.named_parameters()),
        "tp_size": trainer.pass_config.tp_size, "fsdp_degree": trainer.fsdp_degree,
        "all_reduces": sum(n.op == "call_function" and "all_reduce" in str(n.target)
                           for n in gm.graph.nodes),
    }


def hybrid_case():
    """tp = 2 x dp = 2 on four ranks: the TP shard of TPNet, FSDP over the
    mesh's dp dimension (fc1 planned; head's 3 rows stay replicated)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from hyperparallel.compile import GraphTrainer, MeshContext, PassConfig, PassPlan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ctx = MeshContext(mesh)
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    model = TPNet(ctx.tp_group(), tp_rank, 2)
    trainer = GraphTrainer(model, train_fn, PassConfig(), PassPlan().add_module("fc1"),
                           {"lr": 0.1, "optimizer": torch.optim.SGD}, device="cpu",
                           mesh_context=ctx)
    losses = []
    for s in range(STEPS):
        x, y = batch(s, rows_of(s))
        n = x.shape[0] // 2
        part = slice(dp_rank * n, (dp_rank + 1) * n)
        loss = trainer.train_step(x[part], y[part])
        trainer.optimizer_step()
        dist.all_reduce(loss, group=ctx.fsdp_group())
        losses.append(loss.item() / 2)
    ref_losses, ref = eager_tp_reference(0.1)
    rows = slice(tp_rank * 4, (tp_rank + 1) * 4)
    want = {"fc1.weight": ref["fc1.weight"][rows], "fc1.bias": ref["fc1.bias"][rows],
            "head.weight": ref["head.weight"][:, rows], "head.bias": ref["head.bias"]}
    err, shapes = 0.0, {}
    for n, p in model.named_parameters():
        got = p.detach()
        if n.startswith("fc1"):  # an FSDP shard of a TP shard: gather over dp
            shapes[n] = list(got.shape)
            parts = [torch.empty_like(got) for _ in range(2)]
            dist.all_gather(parts, got.contiguous(), group=ctx.fsdp_group())
            got = torch.cat(parts)
        err = max(err, (got - want[n]).abs().max().item())
    return {"loss_err": max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses)),
            "param_err": err, "shapes": shapes, "tp_size": trainer.pass_config.tp_size,
            "fsdp_degree": trainer.fsdp_degree}


def worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    from hyperparallel.compile import GraphTrainer, MeshContext, PassConfig, PassPlan

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 4:
        with open(os.path.join(sys.argv[1], f"hybrid{rank}.json"), "w") as f:
            json.dump(hybrid_case(), f)
        dist.destroy_process_group()
        return
    plan = PassPlan().add_module("fc1").add_pattern("blocks.*").add_module("norm")
    cases = {
        "overlap": (PassConfig(), {"lr": 0.01, "grad_clip": 0.5}, None),
        "no_overlap": (PassConfig(enable_overlap=False), {"lr": 0.01}, None),
        "reshard": (PassConfig(reshard_after_forward=True, prefetch=None), {"lr": 0.01}, None),
        # the seed's form: one collective per parameter (NOTE [FSDP buckets])
        "per_parameter": (PassConfig(bucket="parameter"), {"lr": 0.01}, None),
        "per_parameter_reshard": (PassConfig(bucket="parameter", reshard_after_forward=True),
                                  {"lr": 0.01}, None),
        "mesh_sgd": (PassConfig(), {"lr": 0.1, "optimizer": torch.optim.SGD}, "mesh"),
    }
    result = {}
    for name, (config, opt_cfg, mesh) in cases.items():
        ctx = None
        if mesh:
            ctx = MeshContext(init_device_mesh("cpu", (1, world), mesh_dim_names=("tp", "dp")))
        model = Net()
        trainer = GraphTrainer(model, train_fn, config, plan, opt_cfg, device="cpu",
                               mesh_context=ctx)
        losses = []
        for s in range(STEPS):
            x, y = batch(s, rows_of(s, name == "overlap"))
            n = x.shape[0] // world
            loss = trainer.train_step(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
            trainer.optimizer_step()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        ref_losses, ref_params = eager(opt_cfg, name == "overlap")
        loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
        param_err, shards = 0.0, {}
        for fqn, p in model.named_parameters():
            full = ref_params[fqn].detach()
            if fqn in trainer.graph_module.fsdp_fqns:
                shards[fqn] = list(p.shape)
                parts = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(parts, p.detach().contiguous())
                got = torch.cat(parts)
            else:
                got = p.detach()
            param_err = max(param_err, (got - full).abs().max().item()
                            / max(1.0, full.abs().max().item()))
        gm = trainer.graph_module
        result[name] = {
            "loss_err": loss_err, "param_err": param_err, "shards": shards,
            "graphs": len(trainer.graph_modules), "fsdp_degree": trainer.fsdp_degree,
            "ops": [str(n.target) for n in gm.graph.nodes if n.op == "call_function"],
        }
    # NOTE [Graph-mode ranks agree before they capture]: another plan, another
    # configuration or another width on one rank is a ValueError on every
    # rank at the first compile, naming what differs (Gloo aborted before).
    mismatch = {}
    for name in ("plan", "config", "width"):
        model, cfg, rank_plan = Net(), PassConfig(), plan
        if rank == 1 and name == "plan":
            rank_plan = PassPlan().add_module("fc1").add_pattern("blocks.*")
        if rank == 1 and name == "config":
            cfg = PassConfig(bucket="parameter")
        if rank == 1 and name == "width":
            model.head = torch.nn.Linear(8, 4).double()
        trainer = GraphTrainer(model, train_fn, cfg, rank_plan, {"lr": 0.01}, device="cpu")
        x, y = batch(0, 8)
        try:
            trainer.train_step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
            mismatch[name] = "trained"
        except ValueError as e:
            mismatch[name] = str(e)
    result["mismatch"] = mismatch
    tp = tp_case(world, rank)
    with open(os.path.join(sys.argv[1], f"tp{rank}.json"), "w") as f:
        json.dump(tp, f)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_ranks(p, tmp_path):
    """p processes of this file (ranks.run_ranks); fails with every failed
    rank's stderr."""
    sys.path.insert(0, HERE)
    import ranks

    ranks.run_ranks(p, [os.path.abspath(__file__), tmp_path], timeout=300)


def test_fsdp_on_two_ranks_equals_eager_training(tmp_path):
    run_ranks(RANKS, tmp_path)
    for r in range(RANKS):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        mismatch = res.pop("mismatch")
        for name, what in (("plan", "PassPlan"), ("config", "PassConfig"),
                           ("width", "model's parameters")):
            other = 1 - r
            msg = mismatch[name]
            assert f"rank {other} of the FSDP group was given another {what}" in msg, (r, msg)
            assert f"than rank {r}: every rank of the group" in msg, (r, msg)
        for name, got in res.items():
            assert got["loss_err"] <= 1e-9, (name, got["loss_err"])
            assert got["param_err"] <= 1e-9, (name, got["param_err"])
            assert got["fsdp_degree"] == 2, name
            # "overlap" recompiles for a new batch shape at its last step.
            assert got["graphs"] == (2 if name == "overlap" else 1), name
            # Planned parameters are 1/2 shards; head (replicated) is not sharded.
            assert got["shards"]["fc1.weight"] == [4, 6], name
            assert got["shards"]["blocks.1.bias"] == [4], name
            assert "head.weight" not in got["shards"], name
            ops = got["ops"]
            # NOTE [FSDP buckets]: one collective per planned module (fc1,
            # blocks.0, blocks.1, norm: 8 parameters), or per parameter.
            per_parameter = name.startswith("per_parameter")
            assert ops.count("_c10d_functional.reduce_scatter_tensor.default") == \
                (8 if per_parameter else 4), name
            assert ops.count("_c10d_functional.all_reduce.default") == 2, name
            gathers = ops.count("_c10d_functional.all_gather_into_tensor.default")
            # reshard: the backward gathers again what it reads (blocks.*.weight
            # for dx, norm.weight and norm.bias for layer norm's backward; by
            # module: blocks.0, blocks.1 and norm).
            want = {"reshard": 7, "per_parameter": 8, "per_parameter_reshard": 12}
            assert gathers == want.get(name, 4), (name, gathers)

        # TP on a mesh (tp = 2, dp = 1): the model's TP collective is in the
        # graph (the forward's all-reduce; the input needs no gradient, so f's
        # backward all-reduce is never traced), FSDP is off by degree 1.
        tp = json.loads((tmp_path / f"tp{r}.json").read_text())
        assert tp["loss_err"] <= 1e-9 and tp["param_err"] <= 1e-9, tp
        assert (tp["tp_size"], tp["fsdp_degree"], tp["all_reduces"]) == (2, 1, 1), tp



def test_tp_by_fsdp_on_four_ranks_equals_eager_training(tmp_path):
    run_ranks(4, tmp_path)
    for r in range(4):
        got = json.loads((tmp_path / f"hybrid{r}.json").read_text())
        assert got["loss_err"] <= 1e-9 and got["param_err"] <= 1e-9, got
        assert (got["tp_size"], got["fsdp_degree"]) == (2, 2), got
        # fc1: 8 rows, 4 per TP rank, 2 per FSDP shard of that.
        assert got["shapes"] == {"fc1.weight": [2, 6], "fc1.bias": [2]}, got


if __name__ == "__main__":
    worker()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
