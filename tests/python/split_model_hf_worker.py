"""One rank of test_split_model_hf.py's training test (started with torchrun's
variables): for every transformers decoder of MODELS (tiny float64 configs,
random init from a fixed seed; tied input and output embeddings where the
model ties them by default, and a tied Llama) and each schedule, cuts the
model with hyperparallel.pipeline.split_model, trains it STEPS SGD steps with
hyperparallel.pipeline.Pipeline over a Gloo group (a padding mask given to
step() as the model's attention_mask; the sequence length changing across
steps), and saves the losses and its chunks' parameters by the model's names.

    split_model_hf_worker.py OUT_DIR SCHEDULES

The models, data and single-process reference are here too (the test
imports them)."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hyperparallel as hp  # noqa: E402
from one_process import train_steps  # noqa: E402

P, MB, T, VOCAB, STEPS, LR = 2, 2, 5, 96, 3, 0.1
SCHEDULES = ("zbv", "zb-h1")

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
              attn_implementation="eager", tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(experts_implementation="eager")  # grouped_mm has no float64
# model key: (model_type, config beyond COMMON). Sliding windows of 3 with at
# most 2 padded tokens: every query sees a token.
MODELS = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=3)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=2)),
    "qwen3": ("qwen3", dict(head_dim=8)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, **MOE)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24, **MOE)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    head_dim=8, **MOE)),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, n_shared_experts=1,
                                        first_k_dense_replace=1, n_group=2, topk_group=1,
                                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
                                        **MOE)),
    "gemma": ("gemma", dict(head_dim=8, tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(head_dim=8, sliding_window=3, final_logit_softcapping=3.0,
                              attn_logit_softcapping=5.0, tie_word_embeddings=True)),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", dict(n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          tie_word_embeddings=True)),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)),
    "olmo2": ("olmo2", {}),
}
TIED = ("llama_tied", "gemma", "gemma2", "gpt2")
# Built on the meta device, each rank making real its own chunks (NOTE [A
# model built on the meta device]); the reference is the whole model made
# real by hp.pipeline.materialize with the same seed.
META = ("llama_tied", "deepseek_v3", "gemma2", "gpt2", "phi3")
META_SEED = 99
# The memory case: float64, parameters far above activations (one row of 8
# tokens per microbatch), Adam without
# foreach (whose temporaries are a copy of all parameters). ~67 MB of parameters.
MEM = dict(vocab_size=2048, hidden_size=256, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
           attn_implementation="eager", tie_word_embeddings=False)


def make_model(key):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = MODELS[key]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config).to(torch.float64)


def make_meta_model(key, **config_extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    if key == "mem":
        config = AutoConfig.for_model("llama", **MEM)
        dtype = torch.float64
    else:
        model_type, extra = MODELS[key]
        config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
        dtype = torch.float64
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def meta_reference(key, m, steps=STEPS, adam=False):
    """reference() for the whole meta-built model made real in one process."""
    model = hp.pipeline.materialize(make_meta_model(key), seed=META_SEED)
    return _train_one_process(model, m, steps, adam)


# Pretrained weights in and out (NOTE [Checkpoints of a rank's chunks]):
# checkpoints the test writes with transformers' save_pretrained (DeepSeek-V3
# sharded: its experts saved unfused), loaded into meta-built chunks, trained
# with SGD + momentum, saved back; DCP checkpoints of the same run at another
# pipeline size, both ways, on DCP_KEY.
PRE = ("llama_tied", "deepseek_v3", "gemma2")
PRE_SHARDED = "deepseek_v3"
DCP_KEY = "llama_tied"


def write_pretrained(key, folder):
    make_model(key).save_pretrained(folder, **({"max_shard_size": "20KB"}
                                               if key == PRE_SHARDED else {}))


def from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                attn_implementation="eager",
                                                experts_implementation="eager")


def momentum(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def all_chunks(model, sched):
    """Every chunk of the schedule over one model (one process)."""
    chunks = {}
    for r in range(sched.num_ranks):
        chunks.update(hp.pipeline.split_model(model, sched, r))
    return chunks


def one_process_steps(model, opt, m, steps):
    """The given steps of single-process training; their losses."""
    return train_steps(model, opt, loss_fn, (batch(step, m) for step in steps), m)


def mem_batch(step, m):
    g = torch.Generator().manual_seed(90 + step)
    ids = torch.randint(0, MEM["vocab_size"], (m, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch(step, m):
    """Inputs, next-token labels and a padding mask (row i's last i % 3
    tokens); the sequence length changes from step to step (5, 7, 5)."""
    g = torch.Generator().manual_seed(70 + step)
    t = T + 2 * (step % 2)
    ids = torch.randint(0, VOCAB, (m * MB, t + 1), generator=g)
    mask = torch.ones(m * MB, t, dtype=torch.long)
    for i in range(m * MB):
        if i % 3:
            mask[i, t - i % 3:] = 0
    return ids[:, :-1], ids[:, 1:], mask


def reference(key, m):
    """Single-process training of the whole model (mean loss over m
    microbatches, SGD): (losses, {name: parameter})."""
    return _train_one_process(make_model(key), m, STEPS, False)


def _optimizer(params, adam):
    return torch.optim.Adam(params, lr=1e-3, foreach=False) if adam else torch.optim.SGD(params, lr=LR)


def _train_one_process(model, m, steps, adam):
    def batches():
        for step in range(steps):
            if adam:
                x, y = mem_batch(step, m)
                yield x, y, torch.ones_like(x)
            else:
                yield batch(step, m)
    losses = train_steps(model, _optimizer(model.parameters(), adam), loss_fn, batches(), m)
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


def meta_memory(rank):
    """A larger meta-built Llama on zb-h1, 2 Adam steps: this rank's peak of
    CPU tensor memory (the tracking allocator, from before the model is
    built) against its chunks' parameters, and the losses."""
    import hyperparallel._C as _C

    m = 2 * P
    sched = hp.pipeline.schedule("zb-h1", ranks=P, microbatches=m)
    base = _C.profile.memory_allocated()
    _C.profile.reset_peak_memory()
    chunks = hp.pipeline.split_model(make_meta_model("mem"), sched, rank, seed=META_SEED)
    after_split = _C.profile.peak_memory_allocated() - base
    pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
    params = list({id(q): q for c in chunks.values() for q in c.parameters()}.values())
    opt = _optimizer(params, True)
    losses = []
    for step in range(2):
        x, y = mem_batch(step, m)
        opt.zero_grad()
        losses.append(pipe.step(x, y, attention_mask=torch.ones_like(x)))
        opt.step()
    peak = _C.profile.peak_memory_allocated() - base
    own = sum(q.numel() * q.element_size() for q in params)
    del pipe
    return {"losses": losses, "peak": peak, "after_split": after_split, "own": own,
            "params": {n: q.detach().clone() for mod in chunks.values()
                       for n, q in mod.named_model_parameters()}}


def pretrained(rank, out_dir, results):
    """Load, train, save (Hugging Face and DCP); resume from the test's
    one-process DCP checkpoint (NOTE [Checkpoints of a rank's chunks])."""
    m = 2 * P
    sched = hp.pipeline.schedule("zb-h1", ranks=P, microbatches=m)

    def run(chunks, opt, steps, after=None):
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        losses = []
        for step in steps:
            x, y, mask = batch(step, m)
            opt.zero_grad()
            losses.append(pipe.step(x, y, attention_mask=mask))
            opt.step()
            if after:
                after(step)
        return losses

    def params_of(chunks):
        return list({id(q): q for c in chunks.values() for q in c.parameters()}.values())

    for key in PRE:
        chunks = hp.pipeline.split_model(make_meta_model(key), sched, rank, seed=1)
        read = hp.pipeline.load_pretrained(chunks, os.path.join(out_dir, "pre", key))
        opt = momentum(params_of(chunks))

        def after(step, chunks=chunks, opt=opt, key=key):
            if key == DCP_KEY and step == 1:
                hp.pipeline.save_checkpoint(chunks, opt, os.path.join(out_dir, "dcp_two"))
        losses = run(chunks, opt, range(STEPS), after)
        hp.pipeline.save_pretrained(chunks, os.path.join(out_dir, "saved", key))
        results[key, "pretrained"] = {"losses": losses, "files": sorted(set(read.values()))}
    chunks = hp.pipeline.split_model(make_meta_model(DCP_KEY), sched, rank, seed=2)
    opt = momentum(params_of(chunks))
    hp.pipeline.load_checkpoint(chunks, opt, os.path.join(out_dir, "dcp_one"))
    results["resumed"] = {"losses": run(chunks, opt, range(1, STEPS)), "params": {
        n: q.detach().clone() for c in chunks.values() for n, q in c.named_model_parameters()}}


def main():
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    import hyperparallel._C as _C

    _C.profile.install_memory_tracker()  # before any tensor of the memory case
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for key in MODELS:
        for name in names:
            sched = hp.pipeline.schedule(name, ranks=P, microbatches=2 * P)
            model = make_model(key)  # every rank: the whole model, same seed
            chunks = hp.pipeline.split_model(model, sched, rank)
            pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
            # A tied weight held by two chunks of this rank is one parameter:
            # the optimizer steps it once.
            params = list({id(q): q for c in chunks.values() for q in c.parameters()}.values())
            opt = torch.optim.SGD(params, lr=LR)
            losses = []
            for step in range(STEPS):
                x, y, mask = batch(step, sched.num_microbatches)
                opt.zero_grad()
                losses.append(pipe.step(x, y, attention_mask=mask))
                opt.step()
            results[key, name] = {
                "losses": losses,
                "params": {n: q.detach().clone() for mod in chunks.values()
                           for n, q in mod.named_model_parameters()},
                "shared": {c: dict(mod.shared_parameters) for c, mod in chunks.items()},
                "names": {c: mod.module_names for c, mod in chunks.items()},
            }
            del pipe
    for key in META:
        sched = hp.pipeline.schedule("zbv", ranks=P, microbatches=2 * P)
        chunks = hp.pipeline.split_model(make_meta_model(key), sched, rank, seed=META_SEED)
        pipe = hp.pipeline.Pipeline(chunks, sched, loss_fn=loss_fn, timeout=60)
        params = list({id(q): q for c in chunks.values() for q in c.parameters()}.values())
        opt = torch.optim.SGD(params, lr=LR)
        losses = []
        for step in range(STEPS):
            x, y, mask = batch(step, sched.num_microbatches)
            opt.zero_grad()
            losses.append(pipe.step(x, y, attention_mask=mask))
            opt.step()
        results[key, "meta"] = {"losses": losses, "params": {
            n: q.detach().clone() for mod in chunks.values() for n, q in mod.named_model_parameters()}}
        del pipe
    results["mem"] = meta_memory(rank)
    pretrained(rank, out_dir, results)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
