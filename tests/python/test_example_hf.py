"""examples/train_hf.py as a user runs it: torchrun with 2 real processes
trains a transformers causal LM (tiny, from code) cut by split_model, with a
sequence length of its own each step and padded rows (the activation shapes
found by the Pipeline, the padding mask given to every chunk); in float64 its
losses and parameters equal single-process training of the same model on the
same batches."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
ARGS = ["--dtype", "float64", "--steps", "3", "--microbatches", "4", "--microbatch-size", "2",
        "--seq-len", "9", "--min-seq-len", "4", "--layers", "4", "--hidden", "16", "--heads", "2",
        "--kv-heads", "1", "--vocab", "32", "--lr", "0.01", "--seed", "3", "--timeout", "60"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_hf", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(ex, a, m):
    """One process: the whole model, the same batches, the mean over
    microbatches of each one's loss, AdamW. Returns (losses, checksum)."""
    model = ex.make_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    losses = []
    for step in range(a.steps):
        ids, labels, mask = ex.batch(a, step, m)
        opt.zero_grad()
        total = 0.0
        for x, y, k in zip(ids.chunk(m), labels.chunk(m), mask.chunk(m)):
            loss = ex.loss_fn(model(x, attention_mask=k).logits, y) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses, sum(q.detach().double().sum().item() for q in model.parameters())


@pytest.mark.parametrize("schedule,model", [("zbv", "llama"), ("1f1b", "qwen2")])
def test_torchrun_train_hf_equals_single_process_training(schedule, model, tmp_path):
    report = tmp_path / "run.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--schedule", schedule, "--model", model, *ARGS, "--report", str(report)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    got = json.loads(report.read_text())
    ex = load_example()
    a = ex.parser().parse_args(["--schedule", schedule, "--model", model, *ARGS])
    # The steps differ in length (the shapes were found more than once).
    assert len({ex.batch(a, s, 4)[0].shape[1] for s in range(a.steps)}) > 1
    ref_losses, ref_checksum = reference(ex, a, 4)
    for s, (x, y) in enumerate(zip(got["loss"], ref_losses, strict=True)):
        assert abs(x - y) <= 1e-9 * abs(y), f"{schedule} step {s}: {x} vs {y}"
    assert abs(got["parameter_checksum"] - ref_checksum) <= 1e-9 * abs(ref_checksum)
    assert got["model"]["class"].endswith("ForCausalLM") and got["schedule"] == schedule


def test_bad_arguments_are_one_clear_error(monkeypatch, capsys):
    ex = load_example()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for args, message in ((["--min-seq-len", "40"], "--min-seq-len 40 is more than"),
                          (["--heads", "3"], "must divide by --heads"),
                          (["--schedule", "zz"], "unknown schedule 'zz'")):
        with pytest.raises(SystemExit):
            ex.main(args)
        assert message in capsys.readouterr().err
