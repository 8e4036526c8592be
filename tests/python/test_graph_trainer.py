"""GraphTrainer (seed 002 §5, §10): training equal to eager in float64,
train()'s loop and logging, gradient accumulation by FQN and its count
check, any torch.optim optimizer, a graph per input shape, FSDP gating (no
torch.distributed, a world of one: the plain graph), and the errors a bad
plan, mesh, model or config gets before any capture."""

import pytest
import torch
import torch.distributed as dist

from hyperparallel.compile import GraphTrainer, MeshContext, PassConfig, PassPlan
from hyperparallel.compile.trainer import default_device

F64 = torch.float64
C10D = "_c10d_functional"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(5, 6)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])
        self.head = torch.nn.Linear(6, 3)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        for b in self.blocks:
            h = h + torch.relu(b(h))
        return self.head(h)


def loss_fn(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def batch(step, rows=4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 5, generator=g, dtype=F64), torch.randint(0, 3, (rows,), generator=g)


def close(a, b, tol=1e-12):
    return (a - b).abs().max().item() <= tol


def collectives(trainer):
    return [n for gm in trainer.graph_modules for n in gm.graph.nodes
            if n.op == "call_function" and C10D in str(n.target)]


def test_train_equals_eager_adam_with_clipping_and_logs():
    model, ref = Net(), Net()
    logged = []
    trainer = GraphTrainer(model, loss_fn, PassConfig(),
                           optimizer_config={"lr": 0.05, "grad_clip": 0.3}, device="cpu")
    data = [batch(s) for s in range(5)]
    losses = trainer.train(iter(data), max_steps=4, log_interval=2,
                           log_fn=lambda s, l: logged.append((s, l)))
    opt = torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False)
    ref_losses = []
    for x, y in data[:4]:
        opt.zero_grad()
        loss = loss_fn(ref, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        opt.step()
        ref_losses.append(loss.item())
    assert len(losses) == 4
    assert all(abs(a - b) <= 1e-12 for a, b in zip(losses, ref_losses))
    assert all(close(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert logged == [(2, losses[1]), (4, losses[3])]
    assert all(p.grad is None for p in model.parameters())  # zero_grad closes each step
    assert not collectives(trainer)  # no torch.distributed: the plain graph


def test_gradients_accumulate_by_fqn_over_micro_batches():
    model, ref = Net(), Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(), device="cpu")
    for s in range(2):
        trainer.train_step(*batch(s))
        loss_fn(ref, *batch(s)).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert close(p.grad, q.grad), n
    trainer.optimizer_step()
    assert all(p.grad is None for p in model.parameters())


def test_gradient_count_mismatch_is_an_error_not_a_truncation():
    model = Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(), device="cpu")
    trainer.train_step(*batch(0))
    model.extra = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    with pytest.raises(RuntimeError, match="gives 8 gradients for 8 parameter FQNs but the "
                                           "model has 9 trainable parameters; refusing"):
        trainer.train_step(*batch(1))
    del model.extra
    model.head.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="model has 7 trainable parameters"):
        trainer.train_step(*batch(1))


@pytest.mark.parametrize("make", [
    {"optimizer": torch.optim.SGD, "lr": 0.1, "momentum": 0.9},
    {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)},
])
def test_any_torch_optimizer(make):
    model, ref = Net(), Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(), optimizer_config=make, device="cpu")
    losses = trainer.train([batch(s) for s in range(3)])
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        opt.zero_grad()
        loss = loss_fn(ref, *batch(s))
        loss.backward()
        opt.step()
        assert abs(loss.item() - losses[s]) <= 1e-12
    assert all(close(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_a_new_input_shape_compiles_a_new_graph():
    model, ref = Net(), Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(fsdp_enabled=False), device="cpu")
    for rows in (4, 6, 4):
        x, y = batch(rows, rows)
        assert abs(trainer.train_step(x, y).item() - loss_fn(ref, x, y).item()) <= 1e-12
    assert len(trainer.graph_modules) == 2


def test_default_device_and_checks_before_capture():
    assert default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="module 'blocks.7' does not exist in the model Net"):
        GraphTrainer(Net(), loss_fn, PassConfig(), PassPlan().add_module("blocks.7"))
    with pytest.raises(ValueError, match="pattern 'layers.\\*' matches no module"):
        GraphTrainer(Net(), loss_fn, PassConfig(), PassPlan().add_pattern("layers.*"))
    GraphTrainer(Net(), loss_fn, PassConfig(), PassPlan().add_module("blocks.1").add_pattern("f*"))
    with pytest.raises(ValueError, match="grad_clip is -1"):
        GraphTrainer(Net(), loss_fn, PassConfig(), optimizer_config={"grad_clip": -1})
    with pytest.raises(ValueError, match="fsdp_degree is 0"):
        GraphTrainer(Net(), loss_fn, PassConfig(fsdp_degree=0))
    trainer = GraphTrainer(Net(), lambda m, x, y: m(x), PassConfig(), device="cpu")
    with pytest.raises(ValueError, match=r"scalar tensor.*shape \(4, 3\)"):
        trainer.train_step(*batch(0))
    with pytest.raises(TypeError, match="must be a pair"):
        GraphTrainer(Net(), loss_fn, device="cpu").train([torch.zeros(2)])


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_of_one_falls_back_to_the_plain_graph(world_of_one):
    model, ref = Net(), Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(), PassPlan().add_pattern("*"),
                           device="cpu")
    assert abs(trainer.train_step(*batch(0)).item() - loss_fn(ref, *batch(0)).item()) <= 1e-12
    assert trainer.fsdp_degree == 1 and not collectives(trainer)
    assert [p.shape for p in model.parameters()] == [p.shape for p in ref.parameters()]


def test_mesh_errors_name_the_dimension(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="none of the FSDP dimensions.*its dimensions: tp"):
        GraphTrainer(Net(), loss_fn, PassConfig(), mesh_context=MeshContext(mesh))
    with pytest.raises(ValueError, match="no dimension 'fsdp_shard' \\(its dimensions: tp\\)"):
        GraphTrainer(Net(), loss_fn, PassConfig(),
                     mesh_context=MeshContext(mesh, fsdp_dim="fsdp_shard"))
    with pytest.raises(ValueError, match="TP and FSDP are both on dimension 'tp'"):
        GraphTrainer(Net(), loss_fn, PassConfig(), mesh_context=MeshContext(mesh, fsdp_dim="tp"))
    dp = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    trainer = GraphTrainer(Net(), loss_fn, PassConfig(fsdp_degree=2), device="cpu",
                           mesh_context=MeshContext(dp))
    with pytest.raises(ValueError, match="fsdp_degree is 2 but the mesh's FSDP dimension 'dp' "
                                         "has 1 ranks"):
        trainer.train_step(*batch(0))
    trainer = GraphTrainer(Net(), loss_fn, PassConfig(), device="cpu", mesh_context=MeshContext(dp))
    trainer.train_step(*batch(0))
    assert trainer.pass_config.fsdp_degree == 1 and trainer.pass_config.tp_size == 1


@pytest.fixture
def fake_world_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_indivisible_dim0_is_an_error_before_capture(fake_world_of_two):
    model = Net()
    trainer = GraphTrainer(model, loss_fn, PassConfig(), device="cpu")  # no plan: shard all
    with pytest.raises(ValueError, match=r"parameter 'head.weight' has shape \(3, 6\)"):
        trainer.train_step(*batch(0))
    assert not trainer.graph_modules and model.fc1.weight.shape == (6, 5)
    with pytest.raises(ValueError, match="fsdp_degree is 4 but the world has 2 ranks"):
        GraphTrainer(Net(), loss_fn, PassConfig(fsdp_degree=4), device="cpu").train_step(
            *batch(0))
    trainer = GraphTrainer(Net(), loss_fn, PassConfig(), PassPlan().add_pattern("blocks.*"),
                           device="cpu")
    trainer.train_step(*batch(0))
    assert trainer.graph_module.fsdp_fqns == [f"blocks.{i}.{w}" for i in range(2)
                                              for w in ("weight", "bias")]
