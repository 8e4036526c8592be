"""One rank of the expert-parallel test (test_moe_ep.py): pp 2 x ep 2 over 4
processes. Ranks 2e and 2e + 1 form pipeline copy e; ranks {0, 2} and
{1, 3} are the expert-parallel groups (each holds half the experts of its
stage's MoE layers), which are also the data-parallel groups. A tiny float64
transformers MoE model (Mixtral, Qwen3-MoE, DeepSeek-V3) is converted with
hyperparallel.moe.expert_parallel (Qwen2-MoE too), cut by split_model and trained for STEPS
SGD steps on each schedule; copy e reads its half of every global batch;
the second step on has longer sequences and padding. Saves losses, the
auxiliary losses and the parameters by the model's names (an expert weight:
this rank's rows). The models, the data and the one-process reference
(every expert local, the whole global batch) are here too.

    ep_worker.py OUT_DIR CASES   (CASES: model:schedule,... ; WORLD_SIZE 4)

A model name with "+fsdp2" also shards each layer's attention with
FSDP2 over the EP dimension of an (ep, pp) DeviceMesh; one ending in
"+hook" runs every FB pair through DualPipe's overlapped_forward_backward on the
chunks' class (dualpipe_hook); "+overlap" trains with fb_overlap=True under HP_LINK (a modelled link) and
defer_wgrad=False, one with "+defer" with defer_wgrad=True, one with
"+auto" with defer_wgrad="auto" and a gain of -1 (deferred W's chosen after
step 2, for the third), "+ready" with pair_turns="ready", defer_wgrad=True
and w_parts=2, "+ckpt" with every layer checkpointed by transformers'
activation_checkpointing_enable (the flags combine); one
ending in "-dp4" is pp 1 x dp 4 x ep 2 (hp.pipeline.mesh): every rank a
whole pipeline, dp_group the world, the experts over {0, 1} and {2, 3},
expert_dp_group the ranks holding the same experts ({0, 2}, {1, 3})."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import warnings  # noqa: E402

import torch  # noqa: E402

import hyperparallel as hp  # noqa: E402

PP, EP, MB, T, VOCAB, STEPS, LR = 2, 2, 2, 5, 32, 3, 0.1


def variant(kind):
    """(model, {flags after "+"}, pp 1 x dp 4) of a case's model name, e.g.
    "mixtral+fsdp2+overlap" -> ("mixtral", {"fsdp2", "overlap"}, False)."""
    base, *flags = kind.split("+")
    return base.removesuffix("-dp4"), set(flags), base.endswith("-dp4")


def microbatches(schedule):
    return 2 * PP + 2 if schedule == "dualpipev" else 2 * PP


def make_model(kind, dtype=torch.float64, experts="eager"):
    """A tiny float64 MoE model of transformers, seeded; "mixtral-one-expert"
    is Mixtral with one expert per token and a zero router, so that the
    first step sends every token to expert 0 and none to the others.
    `experts`: transformers' experts implementation ("grouped_mm": one
    torch._grouped_mm per projection, which takes no float64)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
                  attn_implementation="eager", experts_implementation=experts)
    if kind.startswith("mixtral"):
        one = kind == "mixtral-one-expert"
        config = tf.MixtralConfig(intermediate_size=16, num_local_experts=4,
                                  num_experts_per_tok=1 if one else 2, **common)
        cls = tf.MixtralForCausalLM
    elif kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(intermediate_size=16, moe_intermediate_size=8, num_experts=4,
                                   num_experts_per_tok=2, head_dim=8, decoder_sparse_step=1,
                                   mlp_only_layers=[], **common)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":
        config = tf.Qwen2MoeConfig(intermediate_size=16, moe_intermediate_size=8, num_experts=4,
                                   num_experts_per_tok=2, shared_expert_intermediate_size=8,
                                   decoder_sparse_step=1, mlp_only_layers=[], **common)
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "deepseek_v3":
        config = tf.DeepseekV3Config(intermediate_size=16, moe_intermediate_size=8,
                                     n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                     topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                     kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                                     qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=2.0,
                                     **{**common, "num_key_value_heads": 2})
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(4321)
    model = cls(config).to(dtype)
    if kind == "mixtral-one-expert":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    if kind == "deepseek_v3":
        # The router starts at zero in transformers' init: give it values.
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    if kind != "deepseek_v3":  # trained without an auxiliary loss (its config has none)
        hp.pipeline.moe_aux_losses(model, coef=0.5, form="layer")
    return model


def titan_layer():
    """torchtitan's MoE layer (softmax top 2 of 4 experts, a shared expert,
    the for-loop experts), float64, seeded."""
    import types

    import torchtitan.models.moe.moe as titan_moe
    from torchtitan.models.moe.moe import MoE, MoEArgs

    # torchtitan counts the tokens per expert with torch.histc over int64
    # ids, which has a CUDA kernel only (torch 2.11: "histogram_cpu" not
    # implemented for 'Long'); on the CPU its module counts them with
    # bincount, the same numbers.
    if not isinstance(titan_moe.torch, types.SimpleNamespace):
        shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch)
                                        if not k.startswith("__")})
        shim.histc = lambda x, bins, min, max: torch.bincount(x, minlength=bins)[:bins]
        titan_moe.torch = shim

    args = MoEArgs(num_experts=4, num_shared_experts=1, score_func="softmax", top_k=2,
                   use_grouped_mm=False, load_balance_coeff=None)
    layer = MoE(args, dim=8, hidden_dim=12).to(torch.float64)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for q in layer.parameters():
            q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float64) * 0.3)
    return layer


def titan_input(copy):
    return torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(30 + copy),
                       dtype=torch.float64)


def titan_run(layer, copy):
    """Output, input gradient and parameter gradients of (out**2).sum()."""
    x = titan_input(copy).requires_grad_(True)
    out = layer(x)
    (out * out).sum().backward()
    return out.detach(), x.grad, {k: q.grad.clone() for k, q in layer.named_parameters()}


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch(step, m):
    """The global batch of a step (both copies' rows): inputs, targets and,
    from the second step on, longer sequences with a padding mask."""
    g = torch.Generator().manual_seed(70 + step)
    t = T + 2 * min(step, 1)
    ids = torch.randint(0, VOCAB, (EP * m * MB, t + 1), generator=g)
    mask = None
    if step > 0:
        mask = torch.ones(EP * m * MB, t, dtype=torch.int64)
        mask[::2, -1] = 0
    return ids[:, :-1], ids[:, 1:], mask


def reference(kind, m, dtype=torch.float64):
    """One process, every expert local (transformers' loop over experts):
    each copy's microbatches in turn, the mean over all of them of loss +
    auxiliary losses, SGD. Returns (losses, auxiliary means, {name: parameter})."""
    model = make_model(kind, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, aux_means = [], []
    n = EP * m
    for step in range(STEPS):
        x, y, mask = batch(step, m)
        opt.zero_grad()
        total = aux_total = 0.0
        for mb in range(n):
            rows = slice(mb * MB, (mb + 1) * MB)
            kw = {} if mask is None else {"attention_mask": mask[rows]}
            with hp.pipeline.collect_losses() as added:
                out = model(x[rows], **kw)
            main = loss_fn(out.logits, y[rows])
            aux = sum(added)
            ((main + aux) / n).backward()
            total += main.item() / n
            aux_total += sum(a.item() for a in added) / n
        losses.append(total)
        aux_means.append(aux_total)
        opt.step()
    return losses, aux_means, {k: q.detach().clone() for k, q in model.named_parameters()}


def main():
    import torch.distributed as dist

    out_dir, cases = sys.argv[1], [c.split(":") for c in sys.argv[2].split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == PP * EP
    # The training mesh (hp train's layout): rank 2e + s is copy e, stage
    # rank s; the EP groups are {0, 2} and {1, 3}.
    grid = hp.pipeline.mesh(pp=PP, dp=EP, ep=EP)
    copy, stage_rank = grid.copy, grid.stage_rank
    assert (copy, stage_rank) == divmod(rank, PP)
    pp_group, ep_group = grid.pp, grid.ep
    # pp 1 x dp 4 x ep 2: EP groups {0, 1} and {2, 3}, the same experts on {0, 2} and {1, 3}.
    grid4 = hp.pipeline.mesh(pp=1, dp=4, ep=2)
    mesh = None
    results = {}
    # Counts the grouped products ("+grouped": transformers' grouped_mm
    # experts on this rank's slice, float32; NOTE [Grouped expert products]).
    grouped_calls, plain_grouped_mm = [0], torch._grouped_mm

    def counted(*a, **k):
        grouped_calls[0] += 1
        return plain_grouped_mm(*a, **k)

    torch._grouped_mm = counted
    for kind, name in cases:
        m = microbatches(name)
        base, flags, dp4 = variant(kind)
        sched = hp.pipeline.schedule(name, ranks=1 if dp4 else PP, microbatches=m)
        fsdp = "fsdp2" in flags
        # "+overlap": fb_overlap under a modelled link (HP_LINK), read by the
        # dispatchers expert_parallel makes and by the Pipeline.
        ready = "ready" in flags
        defer = "defer" in flags or ready
        auto = "auto" in flags
        overlap = "overlap" in flags or defer or auto
        # "+ready": ready turns, deferred W's in 2 parts; "+auto": "auto"
        # turns (ready until the W's defer, fixed after); "+fsdp2+overlap":
        # "auto", which FSDP2 makes fixed (NOTE [Ready turns from Python]).
        turns = "ready" if ready else ("auto" if auto or fsdp else "fixed")
        if overlap:
            os.environ["HP_LINK"] = "500,0.5"
        if fsdp and mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            # The same layout: rank 2e + s is copy e, stage rank s.
            mesh = init_device_mesh("cpu", (EP, PP), mesh_dim_names=("ep", "pp"))
        groups = (mesh.get_group("pp"), mesh.get_group("ep")) if fsdp else (pp_group, ep_group)
        # Cut first (split_model runs the model alone to find its layers'
        # inputs), then spread the experts of the chunks, which share the
        # model's modules.
        grouped = "grouped" in flags
        model = (make_model(base, torch.float32, "grouped_mm") if grouped else make_model(base))
        if "ckpt" in flags:  # every layer checkpointed (torch.utils.checkpoint), as HF does it
            model.activation_checkpointing_enable({"use_reentrant": False})
            model.train()
        chunks = hp.pipeline.split_model(model, sched, 0 if dp4 else stage_rank)
        hp.moe.expert_parallel(model, grid4.ep if dp4 else groups[1])
        grouped_calls[0] = 0  # from here on: the pipeline's steps
        length = [T]  # this step's sequence length, for the declared shapes
        extra = {}
        if dp4:
            groups = (grid4.pp, grid4.dp)
            extra["expert_dp_group"] = grid4.expert_dp
            results["dp4-refusals"] = dp4_refusals(hp, chunks, sched, grid4)
        if fsdp:
            # FSDP2 over the EP dimension for the attention of every layer
            # this rank holds; the experts (spread) and the rest (averaged by
            # dp_group) stay plain. FSDP2 stages take declared shapes.
            from torch.distributed.fsdp import fully_shard

            held = {k for c in chunks.values() for k, _ in c.named_model_parameters()}
            for i, layer in enumerate(model.model.layers):
                if f"model.layers.{i}.self_attn.q_proj.weight" in held:
                    fully_shard(layer.self_attn, mesh=mesh["ep"])
            extra["activation_shape"] = lambda st, mb: (MB, length[0], model.config.hidden_size)
        hook_calls[0] = 0
        if "hook" in flags:  # DualPipe's hook on the chunks' class
            for c in chunks.values():
                c.__class__ = type("Hooked" + type(c).__name__, (type(c),),
                                   {"overlapped_forward_backward": classmethod(dualpipe_hook)})
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, group=groups[0],
                                    dp_group=groups[1], timeout=60, fb_overlap=overlap,
                                    defer_wgrad="auto" if auto else defer,
                                    pair_turns=turns if overlap else "fixed",
                                    w_parts=2 if ready else 1, **extra)
        pipe.defer_wgrad_gain = -1.0  # "+auto": always on from step 3
        os.environ.pop("HP_LINK", None)
        opt = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses, aux, dropped, hidden, deferred, reordered = [], [], 0, 0.0, 0, 0
        part = rank if dp4 else copy  # this copy's part of the global batch
        rows = slice(part * m * MB, (part + 1) * m * MB)
        for step in range(STEPS):
            x, y, mask = batch(step, 2 * m if dp4 else m)
            length[0] = x.shape[1]
            opt.zero_grad()
            kw = {} if mask is None else {"attention_mask": mask[rows]}
            with warnings.catch_warnings():  # "+ckpt": torch's checkpoints under a split
                warnings.simplefilter("ignore", RuntimeWarning)
                losses.append(pipe.step(x[rows], y[rows], **kw))
            aux.append(pipe.last_stats["aux_loss"])
            hidden += pipe.last_stats["pair_hidden"]
            reordered += pipe.last_stats["pair_reordered"]
            # Of the exposed seconds, those after the other half ended.
            assert 0 <= pipe.last_stats["pair_exposed_alone"] <= pipe.last_stats["pair_exposed"]
            deferred += (pipe.last_stats["deferred_w_in_waits"]
                         + pipe.last_stats["deferred_w_at_end"])
            opt.step()
        full = {}
        for mod in chunks.values():
            for k, q in mod.named_model_parameters():  # FSDP2's whole (a collective)
                full[k] = (q.full_tensor() if hasattr(q, "full_tensor") else q).detach().clone()
        results[f"{kind}:{name}"] = {
            "losses": losses, "aux": aux, "params": full, "pair_hidden": hidden,
            "deferred": deferred, "choice": pipe.deferred_w_choice, "reordered": reordered,
            "pair_turns": pipe.pair_turns, "grouped_calls": grouped_calls[0], "hook_calls": hook_calls[0],
            "experts": sorted(k for mod in chunks.values() for k, q in mod.named_model_parameters()
                              if hp.moe.is_expert_parameter(q)),
        }
        del pipe
    # torchtitan's MoE layer alone, its experts over the EP group.
    layer = hp.moe.expert_parallel(titan_layer(), ep_group)
    out, dx, grads = titan_run(layer, copy)
    results["titan"] = {"out": out, "dx": dx, "grads": grads,
                        "experts": sorted(k for k, q in layer.named_parameters()
                                          if hp.moe.is_expert_parameter(q))}
    results["titan-first-stage"] = titan_first_stage(hp, copy, ep_group)
    results["recomputing-w"] = recomputing_w_under_ready_turns(hp, copy, stage_rank)
    results["failure"] = fail_in_a_step(hp, copy, stage_rank, pp_group, ep_group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # The groups saw a failure: leave without tearing them down.
    sys.stdout.flush()
    os._exit(0)


hook_calls = [0]


def titan_first_stage(hp, copy, ep_group):
    """torchtitan's layer as a first stage (its input takes no gradient)
    through GradFunction: dx has no input to give back but runs the expert
    exchanges (anchors: NOTE [Anchors] in hp/autograd/split_plan.h), and dw
    only computes. Copy 0 runs its dw while copy 1 waits in a barrier and
    runs its own after: a dw that exchanged would wait for copy 1 and fail
    after the layer's 20 s timeout. Returns the parameters' dw by name."""
    import torch.distributed as dist

    layer = hp.moe.expert_parallel(titan_layer(), ep_group, timeout=20.0)
    x = titan_input(copy)
    out, gf = hp.forward_and_gradfn(layer, x, grad_position=None)
    assert gf.compute_input_grad(2 * out.detach()) is None
    grads = {}
    for turn in range(2):
        if turn == copy:
            names = [k for k, q in layer.named_parameters() if q.requires_grad]
            grads = dict(zip(names, (g.clone() for g in gf.compute_weight_grad())))
        dist.barrier(group=ep_group)
    return grads


def dualpipe_hook(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                  output_grads1, kwargs0=None):
    """DualPipe's overlapped_forward_backward as its example writes it, with
    the step's keyword arguments (the mask) for module0 (NOTE [A chunk's own
    pair] in hyperparallel/pipeline/chunk_pairs.py): the backward half first,
    then the forward, each with its all-to-alls."""
    import hyperparallel as hp

    hook_calls[0] += 1
    if loss1 is not None:
        loss1.backward()
    else:
        hp.pipeline.run_backward(outputs1, output_grads1)
    outputs0 = module0(*inputs0, **(kwargs0 or {}))
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
    loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
    return outputs0, loss0


def dp4_refusals(hp, chunks, sched, grid4):
    """What Pipeline says, on every rank, where dp_group (the world) is larger
    than the expert-parallel group and expert_dp_group is missing, or is not
    one rank of each EP group."""
    out = []
    for edp in (None, grid4.ep):
        try:
            hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, group=grid4.pp,
                                 dp_group=grid4.dp, expert_dp_group=edp, timeout=60)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def recomputing_w_under_ready_turns(hp, copy, stage_rank):
    """Checkpointed experts (torch.utils.checkpoint: every W recomputes their
    forward, all-to-alls included) with ready turns and deferred W's: the
    first deferred W to exchange fails the step (NOTE [Turns as messages
    arrive] in hp/pipeline/overlap.cpp) and every rank's step fails. On
    groups of their own, whose stores the failure marks. Returns the
    error text, or None."""
    import torch.distributed as dist

    mine = {}
    for what, ranks in (("pp", [0, 1]), ("pp", [2, 3]), ("ep", [0, 2]), ("ep", [1, 3])):
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine[what] = g
    sched = hp.pipeline.schedule("dualpipev", ranks=PP, microbatches=microbatches("dualpipev"))
    from torch.utils.checkpoint import checkpoint

    model = make_model("mixtral")
    chunks = hp.pipeline.split_model(model, sched, stage_rank)
    hp.moe.expert_parallel(model, mine["ep"])
    for m in model.modules():  # each experts module (dispatch, experts, combine) checkpointed
        if getattr(m, "_hp_dispatcher", None) is not None:
            plain = m.forward
            m.forward = (lambda *a, plain=plain:
                         checkpoint(plain, *a, use_reentrant=False))
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, group=mine["pp"],
                                dp_group=mine["ep"], timeout=60, fb_overlap=True,
                                defer_wgrad=True, pair_turns="ready")
    m = sched.num_microbatches
    rows = slice(copy * m * MB, (copy + 1) * m * MB)
    x, y, _ = batch(0, m)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # checkpoints under a split
            pipe.step(x[rows], y[rows])
    except Exception as e:  # noqa: BLE001 - what the test checks
        return str(e)
    return None


def fail_in_a_step(hp, copy, stage_rank, pp_group, ep_group):
    """Rank 3 (copy 1, stage 1) raises inside its second step's last
    forward of layer 2, within an overlapped forward-and-backward pair of
    dualpipev (fb_overlap=True), and lives on: every rank's step must fail
    soon, naming what happened, its EP peer (rank 1) through the
    expert-parallel group's store. Returns (error text, seconds from the
    step's start) or None."""
    import time

    sched = hp.pipeline.schedule("dualpipev", ranks=PP, microbatches=microbatches("dualpipev"))
    model = make_model("mixtral")
    chunks = hp.pipeline.split_model(model, sched, stage_rank)
    hp.moe.expert_parallel(model, ep_group)
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, group=pp_group,
                                dp_group=ep_group, timeout=60, fb_overlap=True)
    calls = [0, None]  # layer 2's forwards in this step; the one to fail at

    def fail(module, args):
        calls[0] += 1
        if calls[0] == calls[1]:
            raise RuntimeError("injected failure in rank 3's forward")

    if copy == 1 and stage_rank == 1:
        model.model.layers[2].register_forward_pre_hook(fail)
    m = sched.num_microbatches
    rows = slice(copy * m * MB, (copy + 1) * m * MB)
    for step in range(2):
        x, y, _ = batch(0, m)
        # Step 1 (the shapes known, no probe): layer 2's last forward (of
        # microbatch m - 1), in an FB pair on dualpipev's rank 1.
        calls[:] = [0, m if step == 1 else None]
        t0 = time.perf_counter()
        try:
            pipe.step(x[rows], y[rows])
        except Exception as e:  # noqa: BLE001 - what the test checks
            return str(e), time.perf_counter() - t0
    return None


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
