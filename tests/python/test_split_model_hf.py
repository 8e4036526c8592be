"""hyperparallel.pipeline.split_model on every common transformers decoder
(NOTE [Cutting a transformers decoder]) and on tied input and output
embeddings (NOTE [Parameters shared by chunks]): trained on real processes
(2 ranks, Gloo, float64, zbv and zb-h1, all models in one launch) equal to
single-process training to 1e-9 in losses and every parameter; the chunks in
a row equal the model's logits exactly; models the cut would change are
refused, naming why. Five of them built on the meta device (NOTE [A model
built on the meta device]) train equal to the whole model made real by
materialize(), in the same launch, and a larger meta-built Llama's rank holds
its chunks' memory only (its peak within 10 % of parameters, gradients and
Adam's moments). Pretrained weights: transformers checkpoints (one sharded)
loaded into meta-built chunks, trained, saved back and read whole by
from_pretrained (logits equal to 1e-9); DCP resume from one process to 2
ranks and back equals the uninterrupted run; bad folders are refused."""

import os
import sys
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hyperparallel as hp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ranks as ranks_  # noqa: E402
import split_model_hf_worker as w  # noqa: E402

split_model = hp.pipeline.split_model


def all_chunks(model, sched, **kw):
    chunks = {}
    for r in range(sched.num_ranks):
        chunks.update(split_model(model, sched, r, **kw))
    return [chunks[c] for c in range(sched.num_chunks)]


def _pretrained_before_launch(tmp_path, m):
    """The checkpoints the ranks load, and the one-process reference of the
    pretrained run (SGD + momentum), its DCP checkpoint after step 0 saved on
    the way (what the ranks resume from at pipeline size 2)."""
    for key in w.PRE:
        w.write_pretrained(key, tmp_path / "pre" / key)
    refs = {}
    for key in w.PRE:
        model = w.from_pretrained(tmp_path / "pre" / key)
        opt = w.momentum(model.parameters())
        losses = w.one_process_steps(model, opt, m, [0])
        if key == w.DCP_KEY:
            sched = hp.pipeline.schedule("zb-h1", ranks=w.P, microbatches=m)
            hp.pipeline.save_checkpoint(w.all_chunks(model, sched), opt, tmp_path / "dcp_one")
        losses += w.one_process_steps(model, opt, m, range(1, w.STEPS))
        refs[key] = (losses, model)
    return refs


def _check_pretrained(tmp_path, ranks, refs, m):
    x, _, mask = w.batch(0, m)
    for key in w.PRE:
        ref_losses, ref_model = refs[key]
        for r, res in enumerate(ranks):
            got = res[key, "pretrained"]["losses"]
            assert max(abs(a - b) for a, b in zip(got, ref_losses, strict=True)) <= 1e-9, (key, r)
        # What the ranks saved is a checkpoint transformers loads whole, and
        # its logits are the trained model's.
        back, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "saved" / key, dtype=torch.float64, attn_implementation="eager",
            experts_implementation="eager", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (key, info)
        with torch.no_grad():
            err = (back(x, attention_mask=mask).logits - ref_model(x, attention_mask=mask).logits)
        assert err.abs().max().item() <= 1e-9, (key, err.abs().max().item())
    # Each rank of the sharded checkpoint opened only the shards of its tensors.
    shards = {f for f in os.listdir(tmp_path / "pre" / w.PRE_SHARDED) if f.endswith(".safetensors")}
    for res in ranks:
        assert 0 < len(res[w.PRE_SHARDED, "pretrained"]["files"]) < len(shards)
    # DCP, one process -> 2 ranks: the resumed steps equal the run's.
    ref_losses, ref_model = refs[w.DCP_KEY]
    ref_params = dict(ref_model.named_parameters())
    for res in ranks:
        got = res["resumed"]
        assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses[1:], strict=True)) <= 1e-9
        for n, q in got["params"].items():
            assert (q - ref_params[n]).abs().max().item() <= 1e-9, n
    # DCP, 2 ranks -> one process: the rest of the run from the ranks'
    # checkpoint after step 1 (another start: the weights come from it).
    model = w.from_pretrained(tmp_path / "pre" / w.DCP_KEY)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied: the embedding too
    opt = w.momentum(model.parameters())
    sched = hp.pipeline.schedule("zb-h1", ranks=w.P, microbatches=m)
    hp.pipeline.load_checkpoint(w.all_chunks(model, sched), opt, tmp_path / "dcp_two")
    losses = w.one_process_steps(model, opt, m, range(2, w.STEPS))
    assert abs(losses[0] - ref_losses[2]) <= 1e-9, (losses, ref_losses)
    for n, q in model.named_parameters():
        assert (q - ref_params[n]).abs().max().item() <= 1e-9, n


def test_training_every_decoder_equals_single_process_training(tmp_path):
    refs = _pretrained_before_launch(tmp_path, 2 * w.P)
    ranks_.run_ranks(w.P, [os.path.join(HERE, "split_model_hf_worker.py"), tmp_path,
                           ",".join(w.SCHEDULES)], timeout=600, env={"HF_HUB_OFFLINE": "1"})
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(w.P)]
    m = 2 * w.P
    for key in w.MODELS:
        ref_losses, ref_params = w.reference(key, m)
        initial = dict(w.make_model(key).named_parameters())
        # The steps moved the weights (the comparison below means something).
        assert max((ref_params[n] - q).abs().max().item() for n, q in initial.items()) > 1e-3, key
        for name in w.SCHEDULES:
            sched = hp.pipeline.schedule(name, ranks=w.P, microbatches=m)
            seen = set()
            for r, res in enumerate(ranks):
                got = res[key, name]
                assert sorted(got["names"]) == sched.chunks_of_rank(r), (key, name)
                for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                    assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"{key} {name} rank {r} step {s}: {a} vs {b}"
                for n, q in got["params"].items():
                    err = (q - ref_params[n]).abs().max().item()
                    assert err <= 1e-9 * max(1.0, ref_params[n].abs().max().item()), (
                        f"{key} {name} rank {r} {n}: max error {err}")
                    seen.add(n)
            assert seen == set(ref_params), f"{key} {name}: in no chunk: {set(ref_params) - seen}"
    # Tied embeddings: the first and the last chunk report the weight under
    # the model's one name; on zb-h1 each rank holds its own copy, equal to
    # the reference above after the steps (the gradients were summed).
    for key in w.TIED:
        tied = next(iter(ranks[0][key, "zb-h1"]["shared"][0]))
        assert ranks[0][key, "zb-h1"]["shared"] == {0: {tied: (0, 1)}}, key
        assert ranks[1][key, "zb-h1"]["shared"] == {1: {tied: (0, 1)}}, key
        assert ranks[0][key, "zbv"]["shared"][3] == {tied: (0, 3)}, key  # one rank: one object
        assert torch.equal(ranks[0][key, "zb-h1"]["params"][tied],
                           ranks[1][key, "zb-h1"]["params"][tied]), key
    for key in set(w.MODELS) - set(w.TIED):
        assert all(not s for res in ranks for s in res[key, "zb-h1"]["shared"].values()), key
    # Built on the meta device: each rank made real only its own chunks, and
    # they train equal to the whole model made real by materialize().
    for key in w.META:
        ref_losses, ref_params = w.meta_reference(key, m)
        seen = set()
        for r, res in enumerate(ranks):
            got = res[key, "meta"]
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), f"meta {key} rank {r} step {s}: {a} vs {b}"
            for n, q in got["params"].items():
                assert (q - ref_params[n]).abs().max().item() <= 1e-9, f"meta {key} rank {r} {n}"
                seen.add(n)
        assert seen == set(ref_params), f"meta {key}: in no chunk: {set(ref_params) - seen}"
    # A rank's memory is its chunks': its peak (split, 2 Adam steps) within
    # 10 % of its parameters, gradients and Adam's two moments (activations
    # here are a few hundred KiB), far below the whole model's parameters.
    ref_losses, ref_params = w.meta_reference("mem", m, steps=2, adam=True)
    whole = sum(q.numel() * q.element_size() for q in ref_params.values())
    for r, res in enumerate(ranks):
        mem = res["mem"]
        for a, b in zip(mem["losses"], ref_losses, strict=True):
            assert abs(a - b) <= 1e-9 * abs(b), (r, mem["losses"], ref_losses)
        for n, q in mem["params"].items():  # Adam's steps are 1e-3
            err = (q - ref_params[n]).abs().max().item()
            assert err <= 1e-9, (r, n, err)
        print(f"rank {r}: peak {mem['peak'] / 2**20:.1f} MiB, after split "
              f"{mem['after_split'] / 2**20:.1f} MiB, own parameters {mem['own'] / 2**20:.1f} MiB, "
              f"whole model {whole / 2**20:.1f} MiB")
        assert mem["own"] < 0.7 * whole, r
        assert 4 * mem["own"] <= mem["peak"] <= 1.1 * 4 * mem["own"], (r, mem)
    _check_pretrained(tmp_path, ranks, refs, m)
    # GPT-2's two embedding modules (tokens and learned positions) go together.
    assert ranks[0]["gpt2", "zb-h1"]["names"][0][:3] == ["transformer.wte", "transformer.wpe",
                                                         "transformer.h.0"]
    assert ranks[1]["gpt2", "zb-h1"]["names"][1][-2:] == ["transformer.ln_f", "lm_head"]


@pytest.mark.parametrize("key", list(w.MODELS))
def test_chunks_in_a_row_compute_every_decoders_logits(key):
    model = w.make_model(key)
    ids = torch.randint(0, w.VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 6 + [0]])
    pos = torch.arange(2, 9).unsqueeze(0).expand(3, -1)
    for name, kw in (("zbv", {}), ("zb-h1", {"attention_mask": mask}),
                     ("1f1b", {"attention_mask": mask, "position_ids": pos})):
        sched = hp.pipeline.schedule(name, ranks=2, microbatches=4)
        h = ids
        for chunk in all_chunks(model, sched):
            h = chunk(h, **kw)
        assert torch.equal(h, model(ids, **kw).logits), (key, name)


def test_the_embedding_or_the_tail_alone_in_a_chunk():
    # GPT-2 (learned positions added to the embedding, a tied head): the
    # embedding modules alone in the first chunk, the norm and head alone in
    # the last, as modules= asks.
    model = w.make_model("gpt2")
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)
    h = ids = torch.randint(0, w.VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    chunks = all_chunks(model, sched, modules=[
        ["transformer.wte", "transformer.wpe"], [f"transformer.h.{i}" for i in range(2)],
        ["transformer.h.2", "transformer.h.3"], ["transformer.ln_f", "lm_head"]])
    assert chunks[3].module_names == ["transformer.ln_f", "lm_head"]
    for chunk in chunks:
        h = chunk(h)
    assert torch.equal(h, model(ids).logits)
    with pytest.raises(ValueError, match=r"the embed modules transformer\.wte, transformer\.wpe "
                                         r"of GPT2LMHeadModel are in chunks \[0, 1\]"):
        split_model(model, sched, 0, modules=[
            ["transformer.wte"], ["transformer.wpe", "transformer.h.0", "transformer.h.1"],
            ["transformer.h.2"], ["transformer.h.3"]])


def test_tied_weights_are_reported_under_the_models_name():
    model = w.make_model("llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sched = hp.pipeline.schedule("zbv", ranks=2, microbatches=4)
    chunks = all_chunks(model, sched)
    first, last = dict(chunks[0].named_model_parameters()), dict(chunks[3].named_model_parameters())
    assert first["model.embed_tokens.weight"] is last["model.embed_tokens.weight"]
    assert "lm_head.weight" not in last
    assert chunks[0].shared_parameters == chunks[3].shared_parameters == {
        "model.embed_tokens.weight": (0, 3)}
    assert chunks[1].shared_parameters == {}


def _llama_with_forward(body):
    """A tiny Llama whose base model's forward is `body(base, input_ids, h0)`
    after the embedding (h0): models the cut would change."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    model = w.make_model("llama")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
        h0 = self.embed_tokens(input_ids)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(body(self, input_ids, h0)))

    model.model.forward = types.MethodType(forward, model.model)
    return model


def _layers(base, h, pos, scale=1.0, extra=None):
    pe = base.rotary_emb(h, pos)
    if extra is not None:
        pe = tuple(t + 0 * extra.sum() for t in pe)
    for layer in base.layers:
        h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos)
        h = h * scale if scale != 1.0 else h
    return h


def test_models_the_cut_would_change_are_refused():
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    arange = lambda h: torch.arange(h.shape[1]).unsqueeze(0)  # noqa: E731
    model = _llama_with_forward(lambda b, ids, h: _layers(b, h, arange(h), scale=0.5))
    with pytest.raises(ValueError, match=r"computes between model\.layers\.0 and model\.layers\.1"):
        split_model(model, sched, 0)
    model = _llama_with_forward(lambda b, ids, h: _layers(b, h, arange(h), extra=h))
    with pytest.raises(ValueError, match=r"model\.layers\.0 uses model\.embed_tokens\.weight"):
        split_model(model, sched, 0)
    model = _llama_with_forward(lambda b, ids, h: _layers(b, h, (ids != 0).long().cumsum(-1)))
    with pytest.raises(ValueError, match=r"argument \w+ of model\.layers\.0 changes with the token values"):
        split_model(model, sched, 0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_heads=2))
    with pytest.raises(ValueError, match=r"cannot cut T5ForConditionalGeneration .*encoder-decoder"):
        split_model(t5, sched, 0)


def test_a_meta_model_is_cut_without_storage_for_other_ranks_chunks():
    """A rank's split of a meta-built model gives storage to its own chunks'
    parameters only (the others stay one-element skeletons); materialize of
    the whole model gives the same values; a meta model that is not a
    transformers one is refused naming what to do."""
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    model = w.make_meta_model("llama")
    chunks = split_model(model, sched, 1, seed=5)
    mine = {id(q) for c in chunks.values() for q in c.parameters()}
    for n, q in model.named_parameters():
        assert not q.is_meta, n
        stored = q.untyped_storage().nbytes()
        assert stored == (q.numel() * q.element_size() if id(q) in mine else q.element_size()), n
    whole = dict(hp.pipeline.materialize(w.make_meta_model("llama"), seed=5).named_parameters())
    for n, q in chunks[1].named_model_parameters():
        assert torch.equal(q, whole[n]), n
    other = dict(hp.pipeline.materialize(w.make_meta_model("llama"), seed=6).named_parameters())
    assert not torch.equal(other["lm_head.weight"], whole["lm_head.weight"])  # the seed counts
    with torch.device("meta"):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"Sequential is built on the meta device.*transformers"):
        split_model(seq, sched, 0, blocks="")


def test_a_tied_weight_replaced_in_one_holder_is_refused():
    """fully_shard on the embedding of a tied model replaces its weight in
    that module only; the Pipeline's agreed checks refuse the chunks (the
    copies would train apart) instead of training them untied."""
    from hyperparallel.pipeline.checks import _tied_check

    sched = hp.pipeline.schedule("zb-h1", ranks=2, microbatches=2)
    chunks = split_model(w.make_model("llama_tied"), sched, 0)
    assert _tied_check(chunks) is None
    emb = chunks[0].units[0]
    emb.weight = torch.nn.Parameter(emb.weight.detach().clone())
    why = _tied_check(chunks)
    assert why.startswith("chunk 0: model.embed_tokens.weight, which split_model found shared "
                          "by chunks [0, 1] (tied weights), is no longer one of its"), why


def test_bad_pretrained_folders_are_refused_naming_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    chunks = split_model(w.make_model("llama"), sched, 1)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor"):
        hp.pipeline.load_pretrained(chunks, tmp_path)
    w.make_model("llama").save_pretrained(tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    del tensors["lm_head.weight"]
    (tmp_path / "lacking").mkdir()
    save_file(tensors, tmp_path / "lacking" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of this rank's chunks: lm_head.weight"):
        hp.pipeline.load_pretrained(chunks, tmp_path / "lacking")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7, dtype=torch.float64)
    (tmp_path / "other").mkdir()
    save_file(tensors, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight .* shape \(7,\), the chunk's \(32,\)"):
        hp.pipeline.load_pretrained(chunks, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        hp.pipeline.load_checkpoint(chunks, None, tmp_path / "nothing")



def test_loading_into_chunks_already_sharded_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w.make_model("llama").save_pretrained(tmp_path / "ok")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
        chunks = split_model(w.make_model("llama"), sched, 1)
        fully_shard(chunks[1].units[0], mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"model.layers.2.* is already sharded \(a DTensor\): "
                                             "load the checkpoint into the chunks first"):
            hp.pipeline.load_pretrained(chunks, tmp_path / "ok")
    finally:
        dist.destroy_process_group()


def test_moe_aux_losses_finds_the_routers_of_qwen_moe_and_refuses_deepseek():
    for key in ("qwen2_moe", "qwen3_moe"):
        model = w.make_model(key)
        handles = hp.pipeline.moe_aux_losses(model, form="layer")
        assert len(handles) == 4, key  # one router per MoE layer
        with hp.pipeline.collect_losses() as added:
            model(torch.zeros(1, 3, dtype=torch.long))
        assert len(added) == 4, key
    # DeepSeek-V3 balances its experts without an auxiliary loss.
    with pytest.raises(ValueError, match="trains no router load-balancing loss"):
        hp.pipeline.moe_aux_losses(w.make_model("deepseek_v3"))
