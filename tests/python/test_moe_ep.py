"""Expert parallelism (hyperparallel.moe): the conversion of a model's own
experts, its refusals, and pp 2 x ep 2 on 4 processes equal to one process
in float64 (losses, auxiliary losses, every parameter after 3 SGD steps)
for transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 on fused, split, V and
DualPipe schedules, with a sequence length that changes and padding,
pp 2 x ep 2 x FSDP2 (also inside overlapped pairs), and pp 1 x dp 4 with
the experts over EP groups of 2; in the same launch, torchtitan's MoE layer over each EP
group (also as a first stage through GradFunction: its exchanges run in dx,
its dw only computes) and a rank that fails inside an overlapped pair of a step."""

import os

import pytest
import torch

import hyperparallel as hp
import ranks as ranks_

HERE = os.path.dirname(os.path.abspath(__file__))

# Mixtral on 1f1b, zb-h1, zbv and dualpipev; Qwen3-MoE and DeepSeek-V3 on
# two schedules each, Qwen2-MoE (a gated shared expert) on zbv; the first
# step of mixtral-one-expert sends every token to expert 0 (rank 0 of each EP
# group) and none to the other three; "+fsdp2": pp 2 x ep 2 x FSDP2 (each
# layer's attention fully_shard'ed over the EP dimension, shapes declared);
# "+overlap": fb_overlap=True under HP_LINK (docs/overlap.md), "+defer" with
# defer_wgrad=True too, "+auto" with "auto" choosing them and "auto" turns,
# "+ready" with ready turns and W's in 2 parts, "+ckpt" with transformers'
# activation checkpointing (its recomputes add no auxiliary loss: NOTE
# [Auxiliary losses]) ("+fsdp2+overlap": FSDP2
# inside overlapped pairs, "auto" turns that FSDP2 makes fixed); "+hook":
# DualPipe's overlapped_forward_backward on the chunks' class; "-dp4": pp 1
# x dp 4, each expert held in both EP groups (expert_dp_group); "+grouped":
# float32 with transformers' grouped_mm experts on each rank's slice against
# one process's loop over experts, to float32's precision.
CASES = ["mixtral:1f1b", "mixtral:zb-h1", "mixtral:zbv", "mixtral:dualpipev",
         "qwen3_moe:zb-h1", "qwen3_moe:dualpipev", "qwen2_moe:zbv", "deepseek_v3:zb-h1",
         "deepseek_v3:zbv", "mixtral-one-expert:1f1b", "mixtral+fsdp2:zb-h1",
         "mixtral+overlap:dualpipev", "mixtral+defer:dualpipev", "mixtral+auto:dualpipev",
         "mixtral+ready:dualpipev", "mixtral+ckpt:zbv",
         "mixtral-dp4:1f1b", "mixtral+fsdp2+overlap:dualpipev", "mixtral+grouped:zb-h1",
         "mixtral+hook:dualpipev"]


def test_pp2_ep2_equals_one_process(tmp_path):
    import ep_worker as w

    ranks_.run_ranks(4, [os.path.join(HERE, "ep_worker.py"), tmp_path, ",".join(CASES)],
                     timeout=600, env={"HF_HUB_OFFLINE": "1"})
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for case in CASES:
        kind, name = case.split(":")
        kind, flags, dp4 = w.variant(kind)
        ready = "ready" in flags
        defer = "defer" in flags or ready
        auto = "auto" in flags
        overlap = "overlap" in flags or defer or auto
        # dp 4: four copies of m microbatches, the global batch of 2m per EP copy.
        m = w.microbatches(name)
        grouped = "grouped" in flags
        tol = 1e-5 if grouped else 1e-9
        ref_losses, ref_aux, ref_params = w.reference(kind, 2 * m if dp4 else m,
                                                      torch.float32 if grouped else torch.float64)
        if kind != "deepseek_v3":
            assert min(ref_aux) > 0.01, case  # the load-balancing term matters
        if overlap:  # the pairs hid some of their all-to-alls and transfers (a wait
            # counts only while the CPU computed: a loaded rank may find every
            # message there, so over all ranks)
            assert sum(res[case]["pair_hidden"] for res in results) > 0, f"{case}: nothing hidden"
        if ready or auto:  # ready turns under the link: a half went first (22-27 per rank seen)
            assert sum(res[case]["reordered"] for res in results) > 0, case
        seen = set()
        for r, res in enumerate(results):
            got = res[case]
            copy = r % 2 if dp4 else r // w.PP  # the rank's place in its EP group
            for s in range(w.STEPS):
                for key, ref in (("losses", ref_losses), ("aux", ref_aux)):
                    a, b = got[key][s], ref[s]
                    assert abs(a - b) <= tol * max(1.0, abs(b)), f"{case} rank {r} {key} {s}: {a} vs {b}"
            assert got["experts"], f"{case} rank {r}: no expert parameter"
            # Every MoE layer of the rank's chunks, 2 products each, every step.
            assert (got["grouped_calls"] >= 2 * w.STEPS) == grouped, (case, r, got["grouped_calls"])
            if not overlap:
                assert got["pair_hidden"] == 0, case
            # NOTE [Ready turns from Python]: "auto" stays "auto" (ready
            # until the W's defer) but for FSDP2, which makes it fixed.
            want_turns = ("ready" if ready else "auto" if auto
                          else "fixed")
            assert got["pair_turns"] == want_turns, (case, r, got["pair_turns"])
            if want_turns == "fixed":  # the halves kept the code's order
                assert got["reordered"] == 0, (case, r, got["reordered"])
            # "+hook": every pair through the chunks' overlapped_forward_backward.
            assert (got["hook_calls"] > 0) == ("hook" in flags), (case, r, got["hook_calls"])
            # defer_wgrad: the pairs' weight gradients were queued (and ran);
            # "auto" with a gain of -1: from the third step, every rank of both
            # copies taking copy 0's choice (NOTE [The deferred W's chosen in
            # the run] in hp/pipeline/pipeline.cpp).
            assert (got["deferred"] > 0) == (defer or auto), (case, r, got["deferred"])
            if auto:
                c = got["choice"]
                assert c["defer"] and c["after_step"] == 2 and c["step_with"] > 0, (case, r, c)
                assert c == results[0][case]["choice"], (case, r, c)
            else:
                assert got["choice"] is None, (case, r, got["choice"])
            for n, q in got["params"].items():
                want = ref_params[n]
                if n in got["experts"]:
                    local = want.shape[0] // w.EP
                    assert q.shape[0] == local, (case, n, q.shape)
                    want = want[copy * local:(copy + 1) * local]
                err = (q - want).abs().max().item()
                assert err <= tol * max(1.0, want.abs().max().item()), (case, r, n, err)
                seen.add(n)
        assert seen == set(ref_params), case
    # dp 4 without expert_dp_group, or with one that is not one rank of each
    # EP group: refused on every rank, saying what to give.
    for r, res in enumerate(results):
        missing, wrong = res["dp4-refusals"]
        assert missing is not None and "expert_dp_group=<the ranks of dp_group" in missing, missing
        assert wrong is not None and "must be tiled by the expert-parallel groups" in wrong, wrong
    # torchtitan's MoE layer with its experts over each EP group: the local
    # layer's output and input gradient on the rank's own rows; the
    # experts' gradients from both copies' rows, the rest from its own.
    refs = [w.titan_run(w.titan_layer(), copy) for copy in range(w.EP)]
    for r, res in enumerate(results):
        got, copy = res["titan"], r // w.PP
        out, dx, grads = refs[copy]
        assert torch.allclose(got["out"], out, rtol=0, atol=1e-12), r
        assert torch.allclose(got["dx"], dx, rtol=0, atol=1e-12), r
        assert set(got["experts"]) == {"experts.w1", "experts.w2", "experts.w3"}, got["experts"]
        for k, g in got["grads"].items():
            want = grads[k]
            if k in got["experts"]:
                local = want.shape[0] // w.EP
                want = sum(ref[2][k] for ref in refs)[copy * local:(copy + 1) * local]
            assert torch.allclose(g, want, rtol=0, atol=1e-12), (r, k)
        # The same layer as a first stage through GradFunction: its expert
        # exchanges ran in dx (the peers' dw's ran one after the other, so
        # a dw that exchanged would have failed), and its dw equals plain
        # autograd's parameter gradients.
        first = res["titan-first-stage"]
        assert set(first) == set(got["grads"]), (r, sorted(first))
        for k, g in first.items():
            assert torch.allclose(g, got["grads"][k], rtol=0, atol=1e-12), (r, k)

    # Checkpointed layers under ready turns with deferred W's: a W that
    # recomputes exchanges, which fails the step on every rank, the ranks
    # whose own W's did not get there first naming the rank that told them.
    texts = [res["recomputing-w"] for res in results]
    assert all(t is not None for t in texts), texts
    assert any("a deferred W exchanged with its peers" in t for t in texts), texts
    # Rank 3 raised inside a step (in an overlapped FB pair of dualpipev) and lived on: every rank's step failed
    # within seconds (the timeout is 60 s), its EP peer and its pipeline
    # peer naming it (by its rank in the group they share: its reason from
    # the store, or the transfer to it that failed when its peer's wait was
    # aborted first), and the last rank naming the rank that told it.
    for r, res in enumerate(results):
        assert res["failure"] is not None, f"rank {r}'s step did not fail"
        text, seconds = res["failure"]
        assert seconds < 5, (r, seconds, text)
        if r == 3:
            assert "injected failure" in text, text
        if r in (1, 2):  # rank 3 is rank 1 of their shared group (EP, pipeline)
            assert "rank 1" in text, (r, text)


def test_the_training_mesh_is_hp_trains():
    # NOTE [The training mesh]: (edp, ep, pp), the same checks and words.
    assert hp.pipeline.mesh_shape(16, pp=2, dp=8, ep=4) == [("edp", 2), ("ep", 4), ("pp", 2)]
    assert hp.pipeline.mesh_shape(4, pp=4) == [("edp", 1), ("ep", 1), ("pp", 4)]
    with pytest.raises(ValueError, match="ep 2 does not divide dp 3: .* make dp a multiple of ep"):
        hp.pipeline.mesh_shape(6, pp=2, dp=3, ep=2)
    with pytest.raises(ValueError, match="pp 2 x dp 2 is 4 ranks but the world has 8"):
        hp.pipeline.mesh_shape(8, pp=2, dp=2)
    with pytest.raises(ValueError, match="at least 1"):
        hp.pipeline.mesh_shape(2, pp=0, dp=2)
    with pytest.raises(TypeError, match="pp must be an int"):
        hp.pipeline.mesh_shape(2, pp=2.0)
    from hyperparallel.pipeline.training_mesh import _slices

    assert _slices([2, 2, 1], [0]) == [[0, 2], [1, 3]]  # edp of pp 1 x dp 4 x ep 2
    assert _slices([1, 2, 2], [0, 1]) == [[0, 2], [1, 3]]  # dp of pp 2 x dp 2


def test_conversion_keeps_the_models_values_and_refuses_what_it_cannot_take():
    import ep_worker as w

    model = w.make_model("mixtral")
    x = torch.randint(0, w.VOCAB, (2, 5))
    with hp.pipeline.collect_losses():  # its routers add their loss
        before = model(x).logits
    names = [n for n, _ in model.named_parameters()]
    assert hp.moe.expert_parallel(model, None) is model
    # Names kept, the experts marked, the same logits with every expert local.
    assert [n for n, _ in model.named_parameters()] == names
    experts = hp.moe.expert_parameters(model)
    assert len(experts) == 2 * 4 and all(e.shape[0] == 4 for e in experts)
    with hp.pipeline.collect_losses():
        assert torch.equal(model(x).logits, before)
    with pytest.raises(hp.moe.ExpertParallelError, match="already expert-parallel"):
        hp.moe.expert_parallel(model, None)
    with pytest.raises(hp.moe.ExpertParallelError, match="has no experts collection"):
        hp.moe.expert_parallel(torch.nn.Linear(2, 2), None)
    with pytest.raises(TypeError, match="ep_group must be"):
        hp.moe.expert_parallel(w.make_model("mixtral"), "world")


def test_route_matches_deepseek_v3s_router():
    # The C++ router (sigmoid scores, group-limited choice, correction
    # bias, normalized and scaled weights) against transformers' own.
    import ep_worker as w

    model = w.make_model("deepseek_v3")
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 4))
    h = torch.randn(12, 16, dtype=torch.float64)
    _, want_w, want_i = gate(h)
    logits = torch.nn.functional.linear(h.float(), gate.weight.float())
    got_w, got_i, _ = hp.moe.route(logits, 2, scoring="sigmoid", groups=2, top_groups=1,
                                   scale=2.0, selection_bias=gate.e_score_correction_bias.float())
    order_w, order_g = want_i.sort(-1), got_i.sort(-1)
    assert torch.equal(order_w.values, order_g.values)
    assert torch.allclose(want_w.gather(1, order_w.indices), got_w.gather(1, order_g.indices),
                          rtol=1e-6, atol=1e-7)
