"""examples/train_hf.py as a user runs it: torchrun with 2 real processes
trains a transformers causal LM (tiny, from code) cut by split_model, with a
sequence length of its own each step and padded rows (the activation shapes
found by the Pipeline, the padding mask given to every chunk); in float64 its
losses and parameters equal single-process training of the same model on the
same batches. A local Hugging Face folder (a tiny Llama and a tokenizer made
here) with JSONL text: loaded, saved, resumed and run as 2 copies of the
pipeline under FSDP2, each equal to one process."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_process import train_steps  # noqa: E402

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
    losses = train_steps(model, opt, ex.loss_fn, (ex.batch(a, s, m) for s in range(a.steps)), m)
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


TEXT = ["the quick brown fox jumps over the lazy dog", "a pipeline of stages trains a model",
        "every rank holds its chunks and nothing else", "the dog sleeps while the fox runs"] * 3


def make_model_folder(folder):
    """A local Hugging Face folder as a user has one: a tiny float64 Llama
    (tied embeddings) saved by save_pretrained, and a word-level tokenizer
    trained on TEXT with the tokenizers package (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=len(fast), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, tie_word_embeddings=True,
                         eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(folder)
    fast.save_pretrained(folder)


def torchrun(nproc, args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), EXAMPLE, *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


def test_a_pretrained_folder_with_text_saved_resumed_and_data_parallel(tmp_path):
    """--model-path (meta-built, each rank loading its chunks), --data
    (JSONL through the folder's tokenizer), --save, --resume and --dp 2
    --fsdp: every run's losses equal one process training the folder's model
    on the same packed sequences (float64, 1e-9), and the saved folder is the
    trained model for from_pretrained, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, out = tmp_path / "model", tmp_path / "out"
    make_model_folder(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    common = ["--model-path", str(folder), "--data", str(data), "--seq-len", "8",
              "--microbatches", "4", "--microbatch-size", "1", "--dtype", "float64",
              "--lr", "0.01", "--schedule", "zbv", "--timeout", "60", "--no-progress"]
    ex = load_example()

    def reference(steps, dp):
        a = ex.parser().parse_args(common + ["--steps", str(steps)])
        rows = ex.token_rows(a, AutoTokenizer.from_pretrained(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                     attn_implementation="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        m = 4 * dp
        batches = (ex.data_batch(rows, step, m) for step in range(steps))
        return train_steps(model, opt, ex.loss_fn, batches, m), model

    def losses_of(report):
        return json.loads(report.read_text())["loss"]

    ref5, _ = reference(5, 1)
    ref3, model3 = reference(3, 1)
    torchrun(2, common + ["--steps", "3", "--save", str(out), "--report", str(tmp_path / "a.json")])
    assert max(abs(x - y) for x, y in zip(losses_of(tmp_path / "a.json"), ref3, strict=True)) <= 1e-9
    held = json.loads((tmp_path / "a.json").read_text())["parameter_bytes"]
    assert 0 < held["rank_0"] < held["model"]  # rank 0's chunks only
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    trained = dict(model3.named_parameters())
    for n, q in back.named_parameters():
        assert (q - trained[n]).abs().max().item() <= 1e-9, n
    assert AutoTokenizer.from_pretrained(out)("the dog")["input_ids"] == \
        AutoTokenizer.from_pretrained(folder)("the dog")["input_ids"]
    torchrun(2, common + ["--steps", "5", "--resume", str(out), "--report", str(tmp_path / "b.json")])
    assert max(abs(x - y) for x, y in zip(losses_of(tmp_path / "b.json"), ref5[3:], strict=True)) <= 1e-9
    ref_dp, model_dp = reference(3, 2)
    out_dp = tmp_path / "out_dp"
    torchrun(4, common + ["--steps", "3", "--dp", "2", "--fsdp", "--save", str(out_dp),
                          "--report", str(tmp_path / "c.json")])
    assert max(abs(x - y) for x, y in zip(losses_of(tmp_path / "c.json"), ref_dp, strict=True)) <= 1e-9
    # The parameters too: FSDP2's shards gathered whole by save_pretrained.
    back = AutoModelForCausalLM.from_pretrained(out_dp, dtype=torch.float64)
    trained = dict(model_dp.named_parameters())
    for n, q in back.named_parameters():
        assert (q - trained[n]).abs().max().item() <= 1e-9, n


def test_bad_arguments_are_one_clear_error(monkeypatch, capsys):
    ex = load_example()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for args, message in ((["--min-seq-len", "40"], "--min-seq-len 40 is more than"),
                          (["--heads", "3"], "must divide by --heads"),
                          (["--schedule", "zz"], "unknown schedule 'zz'"),
                          (["--dp", "3"], "--dp 3 does not divide the 2 ranks"),
                          (["--fsdp"], "--fsdp shards over the pipeline's copies"),
                          (["--data", "x.txt"], "--data needs --model-path"),
                          (["--model-path", "/nonexistent"], "no config.json there"),
                          (["--resume", "/nonexistent"], "no checkpoint/train_state.json")):
        with pytest.raises(SystemExit):
            ex.main(args)
        assert message in capsys.readouterr().err
