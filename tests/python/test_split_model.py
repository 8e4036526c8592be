"""hyperparallel.pipeline.split_model: cutting one model into a schedule's
chunks by module names. Training a transformers LlamaForCausalLM cut by it,
and torchtitan's Llama 3 Transformer (a pinned test dependency,
requirements.txt), on real processes (2 ranks, Gloo, float64, several
schedules and ways of cutting in one launch each), equals single-process
training to 1e-9 in losses and every parameter; the single-process tests
check the cuts, the shared parameters and the errors."""

import itertools
import os
import sys

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hyperparallel as hp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ranks as ranks_  # noqa: E402
import split_model_worker as w  # noqa: E402

split_model = hp.pipeline.split_model

# torchtitan 0.2.2's attention module, imported, uses torch.jit.script_method
# (deprecated in torch 2.11).
titan_warnings = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def test_training_a_split_llama_equals_single_process_training(tmp_path):
    names = list(w.CUTS)  # seven schedules: one launch runs them in turn
    ranks_.run_ranks(w.P, [os.path.join(HERE, "split_model_worker.py"), tmp_path, ",".join(names)],
                     timeout=300, env={"HF_HUB_OFFLINE": "1"})
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(w.P)]
    initial = dict(w.make_model().named_parameters())
    # The padding mask (step()'s attention_mask) changes the logits: the
    # stages must have been given it to equal the reference below.
    x, _, mask = w.batch(0, 2)
    with torch.no_grad():
        model = w.make_model()
        assert (model(x, attention_mask=mask).logits - model(x).logits).abs().max().item() > 1e-6
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=w.P, microbatches=2 * w.P)
        ref_losses, ref_params = w.reference(sched.num_microbatches)
        # The steps moved the weights (the comparison below means something).
        assert max((ref_params[n] - q).abs().max().item() for n, q in initial.items()) > 1e-3
        seen = set()
        for r, res in enumerate(ranks):
            got = res[name]
            assert sorted(got["chunks"]) == sched.chunks_of_rank(r), name
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"{name} rank {r} step {s}: {a} vs {b}"
            for c, params in got["chunks"].items():
                for n, q in params.items():
                    err = (q - ref_params[n]).abs().max().item()
                    assert err <= 1e-9 * max(1.0, ref_params[n].abs().max().item()), (
                        f"{name} rank {r} chunk {c} {n}: max error {err}")
                    seen.add(n)
        assert seen == set(ref_params), f"{name}: parameters in no chunk: {set(ref_params) - seen}"
    # The cuts asked for.
    r0, r1 = ranks[0], ranks[1]
    assert r0["1f1b"]["names"][0] == ["model.embed_tokens", "model.layers.0"]
    assert r1["1f1b"]["names"][1] == ["model.layers.1", "model.layers.2", "model.layers.3",
                                      "model.norm", "lm_head"]
    assert [len(r0["zbv"]["names"][c]) for c in (0, 3)] == [2, 3]  # one layer each
    # DualPipe: both ranks hold both chunks (mirrored copies), cut 1 + 3.
    assert r0["dualpipe"]["names"] == r1["dualpipe"]["names"] == r0["1f1b"]["names"] | r1["1f1b"]["names"]


@titan_warnings
def test_training_a_split_torchtitan_llama3_equals_single_process_training(tmp_path):
    # torchtitan's Llama 3 debug model (shrunk), cut with no wrapper: each
    # chunk hands its blocks the model's freqs_cis; the sequence length
    # changes across steps (5, 7, 5).
    import titan_worker as tw

    names = list(tw.CUTS)  # 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev, zb-auto
    ranks_.run_ranks(tw.P, [os.path.join(HERE, "titan_worker.py"), tmp_path, ",".join(names)],
                     timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tw.P)]
    initial = dict(tw.make_model().named_parameters())
    refs = {m: tw.reference(m) for m in {tw.microbatches(n) for n in names}}
    for name in names:
        sched = hp.pipeline.schedule(name, ranks=tw.P, microbatches=tw.microbatches(name))
        ref_losses, ref_params = refs[sched.num_microbatches]
        assert max((ref_params[n] - q).abs().max().item() for n, q in initial.items()) > 1e-3
        seen = set()
        for r, res in enumerate(ranks):
            got = res[name]
            assert sorted(got["chunks"]) == sched.chunks_of_rank(r), name
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"{name} rank {r} step {s}: {a} vs {b}"
            for c, params in got["chunks"].items():
                for n, q in params.items():
                    err = (q - ref_params[n]).abs().max().item()
                    assert err <= 1e-9 * max(1.0, ref_params[n].abs().max().item()), (
                        f"{name} rank {r} chunk {c} {n}: max error {err}")
                    seen.add(n)
        assert seen == set(ref_params), f"{name}: parameters in no chunk: {set(ref_params) - seen}"
    r0, r1 = ranks[0]["1f1b"]["names"], ranks[1]["1f1b"]["names"]
    assert r0 == {0: ["tok_embeddings", "layers.0"]}
    assert r1 == {1: ["layers.1", "layers.2", "layers.3", "norm", "output"]}
    assert ranks[0]["zbv"]["names"][0] == ["tok_embeddings"]  # zbv: rank 0 holds chunks 0 and 3
    assert ranks[0]["interleaved-1f1b"]["names"] == {0: ["tok_embeddings", "layers.0"],
                                                     2: ["layers.2"]}


@titan_warnings
def test_torchtitan_chunks_in_a_row_compute_the_models_logits():
    import titan_worker as tw
    from torchtitan.models.llama3 import Transformer

    model = tw.make_model()
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)
    ids = torch.randint(0, tw.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    # The model's keyword argument positions (step(..., positions=)), handed
    # to every block as its forward does: shifted positions change the logits.
    pos = torch.arange(3, 10).unsqueeze(0).expand(2, -1)
    for kw in ({}, {"positions": pos}):
        h = ids
        for chunk in all_chunks(model, sched):
            h = chunk(h, **kw)
        assert torch.equal(h, model(ids, **kw))
    assert not torch.equal(model(ids, positions=pos), model(ids))
    # transformers' names (a step's kwargs meant for another model) are refused.
    with pytest.raises(TypeError, match=r"position_ids= is no argument"):
        all_chunks(model, sched)[1](torch.zeros(2, 7, 16, dtype=torch.float64), position_ids=pos)
    # The chunks read the model's own freqs_cis (no copy): a new table is
    # what they use, as the model's forward does.
    chunks = all_chunks(model, sched)
    model.freqs_cis = model.freqs_cis * 1j
    h = ids
    for chunk in chunks:
        h = chunk(h)
    assert torch.equal(h, model(ids))
    # Modules set to None (torchtitan's own pipeline cut) are no units.
    model.tok_embeddings = None
    chunks = all_chunks(model, hp.pipeline.schedule("1f1b", ranks=2, microbatches=2))
    assert chunks[0].module_names == ["layers.0", "layers.1"]
    # Other torchtitan models are refused, not cut by guess.
    other = type("Other", (Transformer,), {"__module__": "torchtitan.models.other"})
    model.__class__ = other
    with pytest.raises(ValueError, match=r"not of torchtitan\.models\.other\.Other"):
        split_model(model, sched, 0)


def tiny(cls_name, layers=4, **extra):
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
              tie_word_embeddings=False, attn_implementation="eager")
    config = config_cls(**{**kw, **extra})
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).to(torch.float64)


def all_chunks(model, sched, **kw):
    chunks = {}
    for r in range(sched.num_ranks):
        chunks.update(split_model(model, sched, r, **kw))
    return [chunks[c] for c in range(sched.num_chunks)]


@pytest.mark.parametrize("form,p,names", [
    ("model", 2, ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "zb-auto"]),
    ("model", 4, ["1f1b", "zb-h1"]),  # four layers: four chunks
    ("layer", 2, ["zb-h1", "zbv"]),
])
def test_training_a_split_mixtral_with_its_load_balancing_loss_equals_one_process(
        form, p, names, tmp_path):
    # NOTE [MoE load balancing in a pipeline]: "model", the model's own term
    # over all layers, equals transformers' output_router_logits loss (its
    # sums travel between stages, its gradient back through them); "layer":
    # every MoE layer's term joins its own stage's backward. On fused and
    # split schedules, V shapes, DualPipeV and interleaved, with padding and
    # a sequence length that changes.
    import moe_worker as mw

    ranks_.run_ranks(p, [os.path.join(HERE, "moe_worker.py"), tmp_path, ",".join(names), form],
                     timeout=300, env={"HF_HUB_OFFLINE": "1"})
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(p)]
    for name in names:
        ref_losses, ref_aux, ref_params = mw.reference(mw.microbatches(name, p), form)
        assert min(ref_aux) > 0.1  # the term matters
        seen = set()
        for r, res in enumerate(ranks):
            got = res[name]
            for s in range(mw.STEPS):
                for key, ref in (("losses", ref_losses), ("aux", ref_aux)):
                    a, b = got[key][s], ref[s]
                    assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"{name} rank {r} {key} {s}: {a} vs {b}"
            for n, q in got["params"].items():
                err = (q - ref_params[n]).abs().max().item()
                assert err <= 1e-9 * max(1.0, ref_params[n].abs().max().item()), (name, r, n, err)
                seen.add(n)
        assert seen == set(ref_params), name


@pytest.mark.parametrize("cls_name,extra", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"attn_implementation": "sdpa"}),  # the mask may be None: is_causal
    ("MistralForCausalLM", {"sliding_window": 3}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}),
    ("Qwen3ForCausalLM", {"head_dim": 8}),
])
def test_chunks_in_a_row_compute_the_models_logits(cls_name, extra):
    # Each chunk computes the positions, rotary embeddings and causal mask
    # (full or sliding-window, per layer) itself: equal to the model's forward.
    model = tiny(cls_name, **extra)
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    h = ids
    for chunk in all_chunks(model, sched):
        h = chunk(h)
    assert torch.equal(h, model(ids).logits)
    # The model's own keyword arguments, given to every chunk as the
    # Pipeline gives them (step(..., attention_mask=, position_ids=)):
    # padding and shifted positions change the logits, and the chunks follow.
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    pos = torch.arange(2, 9).unsqueeze(0).expand(2, -1)
    h = ids
    for chunk in all_chunks(model, sched):
        h = chunk(h, attention_mask=mask, position_ids=pos)
    want = model(ids, attention_mask=mask, position_ids=pos).logits
    # (equal_nan: under a sliding window a padded query may see no key at all,
    # NaN in the model's forward and the chunks' alike)
    torch.testing.assert_close(h, want, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(want.nan_to_num(), model(ids).logits)


def test_chunks_share_the_models_parameters():
    model = tiny("LlamaForCausalLM")
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)
    chunks = all_chunks(model, sched)
    by_name = dict(model.named_parameters())
    ids = []
    for chunk in chunks:
        for n, q in chunk.named_model_parameters():
            assert q is by_name[n]
        assert {id(q) for q in chunk.parameters()} == {
            id(q) for _, q in chunk.named_model_parameters()}
        ids.extend(id(q) for q in chunk.parameters())
    assert sorted(ids) == sorted(id(q) for q in model.parameters())  # each exactly once
    # An optimizer over the chunks' parameters steps the model.
    for q in chunks[0].parameters():
        q.grad = torch.ones_like(q)
    before = model.model.embed_tokens.weight.detach().clone()
    torch.optim.SGD(chunks[0].parameters(), lr=0.5).step()
    assert torch.equal(model.model.embed_tokens.weight, before - 0.5)


class Generic(nn.Module):
    """A model of one-tensor blocks: embedding, blocks of uneven widths, tail."""

    def __init__(self, widths=(3, 1, 1, 6, 2, 2, 1), container="list"):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(10, 4, dtype=torch.float64)
        blocks = [nn.Sequential(nn.Linear(4, 4 * wd, dtype=torch.float64), nn.Tanh(),
                                nn.Linear(4 * wd, 4, dtype=torch.float64)) for wd in widths]
        self.blocks = (nn.ModuleList(blocks) if container == "list" else
                       nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)}))
        self.ln = nn.LayerNorm(4, dtype=torch.float64)
        self.head = nn.Linear(4, 10, dtype=torch.float64)

    def forward(self, x):
        h = self.tok(x)
        for b in (self.blocks if isinstance(self.blocks, nn.ModuleList) else self.blocks.values()):
            h = b(h)
        return self.head(self.ln(h))


GENERIC = dict(embed=["tok"], blocks="blocks", tail=["ln", "head"])


@pytest.mark.parametrize("container", ["list", "dict"])
def test_a_model_given_by_names(container):
    model = Generic(container=container)
    sched = hp.pipeline.schedule("1f1b", ranks=3, microbatches=3)
    chunks = all_chunks(model, sched, **GENERIC)
    key = "blocks.0" if container == "list" else "blocks.b0"
    assert chunks[0].module_names == ["tok", key, key[:-1] + "1", key[:-1] + "2"]  # 7 = 3 + 2 + 2
    assert [len(c.module_names) for c in chunks] == [4, 2, 4]
    x = torch.randint(0, 10, (2, 5))
    h = x
    for c in chunks:
        h = c(h)
    assert torch.equal(h, model(x))


def test_by_parameters_balances_the_largest_chunk():
    model = Generic()
    sched = hp.pipeline.schedule("1f1b", ranks=3, microbatches=3)
    chunks = all_chunks(model, sched, by="parameters", **GENERIC)
    got = max(sum(q.numel() for q in c.parameters()) for c in chunks)
    # Brute force over every cut of the 7 blocks into 3 non-empty runs.
    sizes = [sum(q.numel() for q in b.parameters()) for b in model.blocks]
    head = sum(q.numel() for q in model.tok.parameters())
    tail = sum(q.numel() for m in (model.ln, model.head) for q in m.parameters())
    best = min(
        max(head + sum(sizes[:i]), sum(sizes[i:j]), sum(sizes[j:]) + tail)
        for i, j in itertools.combinations(range(1, 7), 2)
    )
    assert got == best
    even = all_chunks(model, sched, **GENERIC)  # by layers: 3, 2, 2
    assert got < max(sum(q.numel() for q in c.parameters()) for c in even)


def test_explicit_names_and_layers_per_chunk():
    model = tiny("LlamaForCausalLM")
    sched = hp.pipeline.schedule("1f1b", ranks=3, microbatches=3)
    # The embedding alone in chunk 0; the norm and head, left out, go with the last.
    chunks = all_chunks(model, sched, modules=[
        ["model.embed_tokens"], ["model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3"]])
    assert chunks[0].module_names == ["model.embed_tokens"]
    assert chunks[2].module_names[-2:] == ["model.norm", "lm_head"]
    ids = torch.randint(0, 32, (2, 5))
    h = ids
    for c in chunks:
        h = c(h)
    assert torch.equal(h, model(ids).logits)
    chunks = all_chunks(model, sched, layers_per_chunk=[2, 1, 1])
    assert chunks[0].module_names == ["model.embed_tokens", "model.layers.0", "model.layers.1"]


def test_bad_splits_name_the_module():
    model = tiny("LlamaForCausalLM")
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"no module named 'model\.layers\.9'"):
        split_model(model, sched, 0, modules=[["model.layers.0", "model.layers.9"],
                                              ["model.layers.1"]])
    with pytest.raises(ValueError, match=r"no module named 'model\.layrs\.0'.*model\.layers\.0"):
        split_model(model, sched, 0, modules=[["model.layrs.0"], ["model.layers.1"]])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp' is a module of the model but not"):
        split_model(model, sched, 0, modules=[["model.layers.0.mlp"], ["model.layers.1"]])
    with pytest.raises(ValueError, match=r"block 'model\.layers\.3' is in no chunk"):
        split_model(model, sched, 0, modules=[["model.layers.0"], ["model.layers.1", "model.layers.2"]])
    with pytest.raises(ValueError, match=r"'model\.layers\.1' \(chunk 0\) comes after 'model\.layers\.0' \(chunk 1\)"):
        split_model(model, sched, 0, modules=[["model.layers.1"], ["model.layers.0", "model.layers.2",
                                                                   "model.layers.3"]])
    with pytest.raises(ValueError, match="layers_per_chunk must be 2 ints"):
        split_model(model, sched, 0, layers_per_chunk=[1, 2])
    with pytest.raises(ValueError, match=r"no module named 'blockz'"):
        split_model(Generic(), sched, 0, embed=["tok"], blocks="blockz")
    with pytest.raises(ValueError, match=r"'ln' is a LayerNorm, not an nn\.ModuleList"):
        split_model(Generic(), sched, 0, blocks="ln")
    with pytest.raises(ValueError, match="cannot find the blocks of Generic"):
        split_model(Generic(), sched, 0)


def test_more_chunks_than_layers_names_the_blocks():
    model = tiny("LlamaForCausalLM", layers=3)
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)  # 4 chunks
    with pytest.raises(ValueError, match=r"cannot cut 'model\.layers' \(3 blocks\) into the schedule's 4 chunks"):
        split_model(model, sched, 0)
    # Possible with the embedding alone in a chunk.
    chunks = all_chunks(model, sched, modules=[["model.embed_tokens"], ["model.layers.0"],
                                               ["model.layers.1"], ["model.layers.2"]])
    assert chunks[3].module_names == ["model.layers.2", "model.norm", "lm_head"]


def test_moe_aux_losses_refuses_a_second_registration_and_an_unknown_form():
    import moe_worker as mw

    model = mw.make_model()
    handles = hp.pipeline.moe_aux_losses(model)
    assert len(handles) == 4  # one per router
    with pytest.raises(ValueError, match="already add their loss"):
        hp.pipeline.moe_aux_losses(model, form="layer")
    with pytest.raises(ValueError, match="form must be 'model' or 'layer'"):
        hp.pipeline.moe_aux_losses(mw.make_model(), form="global")
    # Removing the handles turns it off: the chunks hand on hidden states only.
    for h in handles:
        h.remove()
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    chunk = hp.pipeline.split_model(model, sched, 0)[0]
    assert isinstance(chunk(torch.zeros(1, 3, dtype=torch.int64)), torch.Tensor)
    hp.pipeline.moe_aux_losses(model, form="layer")
