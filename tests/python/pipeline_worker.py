"""One rank of the Python runtime tests (started by test_pipeline_runtime.py
with torchrun's variables): trains a small float64 model with every schedule
on hyperparallel's executor over a Gloo group made by torch.distributed, and
saves its losses and chunk parameters for the test to compare with
single-process training.

    pipeline_worker.py OUT_DIR SCHEDULES [DP [DEVICE [LOOKAHEAD [P2P]]]]

DEVICE "cuda" puts the rank of local rank r on GPU r mod the GPU count (two
ranks may share one GPU: the runtime stages through host memory over Gloo).
LOOKAHEAD is Pipeline's receive_lookahead; given, the runtime also leaves
glibc's malloc as it is and runs without the step cache
(keep_freed_memory=False): the non-default paths.
P2P is Pipeline's p2p ("auto", "group" or "shm"; not given: Pipeline's
default)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_model as pm  # noqa: E402

import hyperparallel as hp  # noqa: E402


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    dp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
    lookahead = int(sys.argv[5]) if len(sys.argv) > 5 else None
    p2p = {"p2p": sys.argv[6]} if len(sys.argv) > 6 else {}
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world_rank, world = dist.get_rank(), dist.get_world_size()
    if dp > 1:
        # dp copies of a pipeline of world / dp ranks, as torch's DeviceMesh
        # lays them out (row-major: the ranks of one pipeline are consecutive).
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "pp"))
        group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        rank, p, replica = mesh.get_local_rank("pp"), world // dp, mesh.get_local_rank("dp")
    else:
        group, dp_group, rank, p, replica = None, None, world_rank, world, 0
    results = {}
    for name in names:
        m = pm.microbatches(name, p)
        sched = hp.pipeline.schedule(name, ranks=p, microbatches=m)
        chunks = {c: pm.make_chunk(c, sched.num_chunks).to(device)
                  for c in sched.chunks_of_rank(rank)}
        pipe = hp.pipeline.Pipeline(
            chunks,
            sched,
            loss_fn=pm.loss_fn,
            activation_shape=(pm.MB, pm.D),
            timeout=60,
            group=group,
            dp_group=dp_group,
            receive_lookahead=0 if lookahead is None else lookahead,
            keep_freed_memory=None if lookahead is None else False,
            **p2p,
        )
        params = [q for c in chunks.values() for q in c.parameters()]
        opt = torch.optim.SGD(params, lr=pm.LR)
        losses = []
        for step in range(pm.STEPS):
            x, y = pm.batch(step, dp * m)  # the global batch; this copy's share below
            rows = m * pm.MB
            x, y = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            losses.append(pipe.step(x, y))
            opt.step()
        results[name] = {
            "losses": losses,
            "chunks": {c: [q.detach().cpu() for q in mod.parameters()] for c, mod in chunks.items()},
            "device": str(next(q for c in chunks.values() for q in c.parameters()).device),
            "backend": pipe._runtime.backend,
            "p2p": pipe.p2p,
            # Free blocks of the step cache (process-wide: after this and the
            # schedules before it).
            "cpu_cache_bytes": hp.pipeline.cpu_cache_bytes(),
        }
    torch.save(results, os.path.join(out_dir, f"rank{world_rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from hyperparallel.train_utils import end_rank

    end_rank()  # NOTE [Gloo work freed during shutdown] in train_utils.py
