"""What the Python sides of the peer benchmark share: the settings, the model
and data (hyperparallel.models: the same GPT and batches as `hp train
--untied`), the rank launcher (torchrun's variables, rank r pinned to core r
with one intra-op thread) and the JSON every side writes."""

import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

SETTINGS = {
    # Bigger matrices: the runtimes' per-action cost is small next to the compute.
    "compute": dict(layers=8, d_model=128, heads=4, seq_len=64, microbatch_size=4,
                    microbatches=8),
    # Many small actions: where a runtime's cost per action shows.
    "overhead": dict(layers=4, d_model=32, heads=4, seq_len=16, microbatch_size=1,
                     microbatches=32),
}


def add_run_arguments(ap):
    """The options every side's worker takes (compare.py passes them on)."""
    ap.add_argument("--setting", required=True, choices=sorted(SETTINGS))
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--out", required=True, help="JSON report (written by rank 0)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--no-pin", action="store_true", help="do not pin rank r to core r")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="profile each rank's steps with cProfile into DIR/rank<r>.prof; rank 0 "
                         "prints its top functions by own time")
    ap.add_argument("--model", default="gpt", choices=["gpt", "hf-llama"],
                    help="the model both sides train (common.chunk_builder)")
    ap.add_argument("--worker", action="store_true", help="(internal) run one rank")


def setup_rank(args):
    """Pins this rank, imports torch with one thread, joins the Gloo group.
    Returns (rank, world, torch, dist)."""
    import faulthandler

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.enable()  # a crash (SIGABRT, SIGSEGV) shows every thread's Python stack
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=True)  # show a hang
    if not args.no_pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, torch, dist


class _OneChunk:
    """The layout split_model needs to cut chunk `index` of `n` on its own."""

    def __init__(self, index, n):
        self.num_chunks, self.num_ranks, self.index = n, 1, index

    def chunks_of_rank(self, rank):
        return [self.index]


def chunk_builder(model, config, seed):
    """fn(chunk, num_chunks) -> the chunk's module, and the width of what a
    chunk hands the next: the GPT of hyperparallel.models (`gpt`), or a
    transformers LlamaForCausalLM of the same shape (`hf-llama`: hidden size
    d_model, heads, 2 key-value heads, MLP 2 x d_model, vocab 256, random
    weights from the seed, eager attention, float32) cut by split_model, the
    same cut on both sides."""
    from hyperparallel import models

    if model == "gpt":
        return (lambda c, n: models.GPT(config, seed, chunk=c, num_chunks=n)), config.d_model
    if model != "hf-llama":
        raise ValueError(f"unknown model {model!r}: gpt or hf-llama")
    import torch
    import transformers

    import hyperparallel as hp

    def build(c, n):
        cfg = transformers.LlamaConfig(
            vocab_size=config.vocab, hidden_size=config.d_model,
            intermediate_size=2 * config.d_model, num_hidden_layers=config.layers,
            num_attention_heads=config.heads, num_key_value_heads=2,
            max_position_embeddings=max(config.seq_len, 16), tie_word_embeddings=False,
            attn_implementation="eager")
        torch.manual_seed(seed)
        whole = transformers.LlamaForCausalLM(cfg)
        return hp.pipeline.split_model(whole, _OneChunk(c, n), 0)[c]
    return build, config.d_model


def model_and_data(setting, seed, dtype=None):
    """(GPTConfig, TextDataset) of a setting: Debian's license texts."""
    import torch
    from hyperparallel import models

    s = SETTINGS[setting]
    config = models.GPTConfig(layers=s["layers"], d_model=s["d_model"], heads=s["heads"],
                              seq_len=s["seq_len"], dtype=dtype or torch.float32)
    return config, models.TextDataset(config, s["microbatch_size"], seed)


class Profile:
    """cProfile around the timed steps when --profile DIR is given (else nothing)."""

    def __init__(self, args, rank):
        self.dir, self.rank, self.prof = args.profile, rank, None

    def __enter__(self):
        if self.dir:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc):
        if self.prof is None:
            return
        import pstats

        self.prof.disable()
        os.makedirs(self.dir, exist_ok=True)
        self.prof.dump_stats(os.path.join(self.dir, f"rank{self.rank}.prof"))
        if self.rank == 0:
            pstats.Stats(self.prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def run_worker(args, run_rank):
    """One rank of a row: `run_rank(args, rank, world, torch, dist, error)`,
    where error[0] says what the rank is doing. A failure writes the row's
    error text (ARGS.out + ".error": the rank, what it was doing, the
    exception's first line) and ends the rank with exit code 1."""
    rank, world, torch, dist = setup_rank(args)
    error = ["starting"]
    try:
        run_rank(args, rank, world, torch, dist, error)
    except BaseException as e:  # noqa: BLE001 - the row's text, then fail the rank
        with open(args.out + ".error", "w") as f:
            text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            f.write(f"rank {rank}, {error[0]}: {type(e).__name__}: {text}".rstrip(": "))
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def end_rank():
    """Ends a rank's process once its work is done and written, without the
    interpreter's shutdown (NOTE [Gloo work freed during shutdown] in
    python/hyperparallel/train_utils.py)."""
    from hyperparallel.train_utils import end_rank as end

    end(0)


def write_result(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, nproc, argv, timeout, threads=1):
    """Starts `script argv --worker` once per rank with torchrun's variables and
    waits for all; a rank that fails or a run past `timeout` ends them all.
    Returns 0 when every rank exited 0."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo",
               USE_LIBUV="0", OMP_NUM_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, script, *argv, "--worker"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(nproc)]
    deadline = time.monotonic() + timeout
    codes = [None] * nproc
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                print(f"{os.path.basename(script)}: timed out after {timeout} s", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        print(f"{os.path.basename(script)}: ranks ended with {codes}", file=sys.stderr)
        return 1
    return 0


def gather_last_step(dist, torch, world, busy, last_end, extra=()):
    """All ranks' (busy seconds, end of the last compute, *extra) of a step."""
    mine = torch.tensor([busy, last_end, *extra], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [[float(v) for v in t] for t in everyone]
