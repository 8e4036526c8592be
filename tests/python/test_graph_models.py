"""Graph mode on real models, float64, against eager single-process training
(losses and parameters to 1e-9 over STEPS Adam steps): the GPT of
hyperparallel.models (tied head) and transformers' LlamaForCausalLM from a
tiny LlamaConfig built here (random init, no hub; one case with tied word
embeddings, so a parameter with two FQNs), each single-process and with
FSDP over two real processes (Gloo), with overlap and with
reshard-after-forward. Run as a script, this file is one rank (torchrun's
variables)."""

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the config is built here

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
STEPS = 3
ROWS = 4  # the global batch; each of RANKS ranks trains ROWS // RANKS of it
LR = 1e-2


# -- the models ------------------------------------------------------------
def gpt_model():
    from hyperparallel.models import GPT, GPTConfig

    config = GPTConfig(layers=2, d_model=16, heads=2, vocab=32, seq_len=8, tied_head=True,
                       dtype=torch.float64)
    return GPT(config, seed=3)


def gpt_train_fn(model, x, y):
    from hyperparallel.models import gpt_loss

    return gpt_loss(model(x), y)


def gpt_batch(step):
    from hyperparallel.models import GPTConfig, RandomTokens

    return RandomTokens(GPTConfig(vocab=32, seq_len=8), ROWS, seed=5).get(step, 0)


def llama_model(tied=False, attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=tied,
                         attn_implementation=attn)
    with torch.random.fork_rng():  # transformers draws the initial values from the global one
        torch.manual_seed(7)
        return LlamaForCausalLM(config).double()


def llama_train_fn(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def llama_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    window = torch.randint(0, 48, (ROWS, 9), generator=g)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


MODELS = {
    "gpt": (gpt_model, gpt_train_fn, gpt_batch),
    "llama": (lambda: llama_model(), llama_train_fn, llama_batch),
    "llama_tied_eager": (lambda: llama_model(tied=True, attn="eager"), llama_train_fn,
                         llama_batch),
}


def eager(name):
    make, train_fn, batch = MODELS[name]
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss = train_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def graph(name, config=None, rank=0, world=1):
    """Graph-mode training of MODELS[name]; rank trains its rows of each batch."""
    from hyperparallel.compile import GraphTrainer, PassConfig

    make, train_fn, batch = MODELS[name]
    model = make()
    trainer = GraphTrainer(model, train_fn, config or PassConfig(), None, {"lr": LR},
                           device="cpu")
    losses = []
    n = ROWS // world
    for s in range(STEPS):
        x, y = batch(s)
        loss = trainer.train_step(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        trainer.optimizer_step()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(loss)  # equal token counts: the mean of the means
        losses.append(loss.item() / world)
    return model, trainer, losses


def errors(name, model, trainer, losses, world=1):
    ref_losses, ref = eager(name)
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    sharded = set(getattr(trainer.graph_module, "fsdp_fqns", ()))
    param_err, shards = 0.0, {}
    for fqn, p in model.named_parameters():
        got = p.detach()
        if fqn in sharded:
            import torch.distributed as dist

            shards[fqn] = list(got.shape)
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            got = torch.cat(parts)
        full = ref[fqn]
        param_err = max(param_err, (got - full).abs().max().item()
                        / max(1.0, full.abs().max().item()))
    ops = [str(n.target) for n in trainer.graph_module.graph.nodes if n.op == "call_function"]
    return {"loss_err": loss_err, "param_err": param_err, "shards": shards,
            "params": len(dict(model.named_parameters())),
            "loss_changed": abs(losses[-1] - losses[0]) > 1e-6,
            "gathers": ops.count("_c10d_functional.all_gather_into_tensor.default"),
            "reduce_scatters": ops.count("_c10d_functional.reduce_scatter_tensor.default")}


# -- single process --------------------------------------------------------
def check(res, name):
    assert res["loss_err"] <= 1e-9, (name, res["loss_err"])
    assert res["param_err"] <= 1e-9, (name, res["param_err"])
    assert res["loss_changed"], name  # the steps really trained


def test_gpt_single_process_equals_eager():
    import torch.distributed as dist

    assert not dist.is_initialized()
    res = errors("gpt", *graph("gpt"))
    check(res, "gpt")
    assert res["gathers"] == 0 and res["shards"] == {}


def test_llama_single_process_equals_eager():
    import transformers  # a pinned dependency (requirements.txt): never skipped

    assert transformers.__version__
    for name in ("llama", "llama_tied_eager"):
        model, trainer, losses = graph(name)
        res = errors(name, model, trainer, losses)
        check(res, name)
        # Tied: lm_head.weight is model.embed_tokens.weight, one state placeholder.
        gm = trainer.graph_module
        if name == "llama_tied_eager":
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert gm.state_aliases["model.embed_tokens.weight"] == ["lm_head.weight"]


# -- FSDP over two processes -------------------------------------------------
CASES = {  # case -> (model, PassConfig kwargs)
    "gpt_overlap": ("gpt", {}),
    "gpt_reshard": ("gpt", {"reshard_after_forward": True}),
    "llama_overlap": ("llama", {}),
    "llama_tied_reshard": ("llama_tied_eager", {"reshard_after_forward": True,
                                                "prefetch": None}),
}


def worker():
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    from hyperparallel.compile import PassConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for case, (name, kwargs) in CASES.items():
        model, trainer, losses = graph(name, PassConfig(**kwargs), rank, world)
        result[case] = errors(name, model, trainer, losses, world)
        result[case]["fsdp_degree"] = trainer.fsdp_degree
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_on_two_ranks_equals_eager(tmp_path):
    sys.path.insert(0, HERE)
    import ranks

    ranks.run_ranks(RANKS, [os.path.abspath(__file__), tmp_path], timeout=300)
    for r in range(RANKS):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(res) == set(CASES)
        for case, got in res.items():
            check(got, case)
            assert got["fsdp_degree"] == 2, case
            # No plan: every distinct trainable parameter is a half shard,
            # reduce-scattered with the others of its module (NOTE [FSDP
            # buckets]): GPT's embed, block<i> and final; Llama's
            # model.layers.<i>, the rest of model, and lm_head.
            modules = set()
            for n in got["shards"]:
                parts = n.split(".")
                modules.add(".".join(parts[:3]) if parts[1:2] == ["layers"] else parts[0])
            assert got["reduce_scatters"] == len(modules) < len(got["shards"]), case
            assert got["gathers"] >= got["reduce_scatters"], case
        gpt = res["gpt_overlap"]["shards"]
        assert gpt["embed.wte"] == [16, 16] and gpt["block0.qkv.weight"] == [24, 16]
        assert "final.head" not in gpt  # tied: the head is embed.wte
        llama = res["llama_overlap"]["shards"]
        assert llama["model.layers.0.self_attn.k_proj.weight"] == [8, 32]
        assert llama["lm_head.weight"] == [24, 32]
        tied = res["llama_tied_reshard"]
        assert "lm_head.weight" not in tied["shards"]
        assert tied["shards"]["model.embed_tokens.weight"] == [24, 32]
        # reshard: the backward gathers again what it reads.
        assert tied["gathers"] > tied["reduce_scatters"]
        assert res["gpt_reshard"]["gathers"] > res["gpt_reshard"]["reduce_scatters"]


if __name__ == "__main__":
    worker()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
