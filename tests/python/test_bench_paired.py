"""bench/peers/paired.py as the benchmark runs it: 2 real processes hold
PyTorch's pipelining and our Python runtime side by side over two Gloo groups
and take turns step by step; both train the same GPT from the same values on
the same batches, so their losses must agree step for step (float32, the
tolerance the benchmark itself applies), and bad arguments are refused; and
bench/peers/paired_fsdp.py, the same with fully_shard'ed stages on 4 ranks."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIRED = os.path.join(ROOT, "bench", "peers", "paired.py")


def run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, PAIRED, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_both_sides_take_turns_and_agree_step_for_step(tmp_path):
    out = tmp_path / "paired.json"
    r = run(["--rounds", "1", "--steps", "3", "--settings", "overhead",
             "--schedules", "1F1B,DualPipeV", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == []
    for name in ("1F1B", "DualPipeV"):
        (run_,) = report["runs"]["overhead"][name]
        theirs, ours = run_["torch"]["losses"], run_["hp-py"]["losses"]
        assert len(theirs) == len(ours) == 3
        for a, b in zip(theirs, ours):
            assert abs(a - b) <= 1e-4 * abs(a), (name, theirs, ours)
        assert theirs[-1] < theirs[0], "the model did not train"
        s = report["settings"]["overhead"][name]
        assert s["pairs"] == 2  # the first step of each side is warm-up
        assert s["q25"] <= s["ratio"] <= s["q75"]
        # The ideal step: a simulated schedule of our side's own action times
        # plus the optimizer's, so a positive time of the order of our step.
        assert 0.2 * s["hp_ms"] < s["ideal_ms"] < 2 * s["hp_ms"], s
        assert s["torch_over_ideal"] > 0
    assert "PyTorch / hp Python, paired" in r.stdout


def test_bad_arguments_are_refused_before_any_run():
    for args, fragment in ((["--schedules", "Nope"], "--schedules"),
                           (["--settings", "huge"], "--settings"),
                           (["--steps", "2"], "--steps")):
        r = run(args, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert fragment in r.stderr


PAIRED_FSDP = os.path.join(ROOT, "bench", "peers", "paired_fsdp.py")


def test_fsdp2_stages_pair_up_and_agree(tmp_path):
    """bench/peers/paired_fsdp.py, one tiny round: pp 2 x dp 2 on 4 ranks, both
    sides' chunks fully_shard'ed over dp; the row has its ratio and both
    sides' times, the losses (the mean over the dp ranks) agree step for
    step, and the memory row holds every rank's peak of our side and of
    PyTorch's."""
    out = tmp_path / "paired_fsdp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, PAIRED_FSDP, "--rounds", "1", "--steps", "3",
                        "--settings", "overhead", "--schedules", "1F1B", "--memory", "1f1b",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == []
    (run_,) = report["runs"]["overhead"]["1F1B"]
    theirs, ours = run_["torch"]["losses"], run_["hp-py"]["losses"]
    assert len(theirs) == len(ours) == 3
    for a, b in zip(theirs, ours):
        assert abs(a - b) <= 1e-4 * abs(a), (theirs, ours)
    assert theirs[-1] < theirs[0], "the model did not train"
    row = report["rows"]["overhead"]["1F1B"]
    assert row["error"] is None
    s = row["summary"]
    assert s["pairs"] == 2 and s["torch_ms"] > 0 and s["hp_ms"] > 0
    assert s["q25"] <= s["ratio"] <= s["q75"]
    mem = report["memory"]["overhead"]["1f1b"]
    for side in ("hp-py", "torch"):
        peak, _, unsharded, ranks = mem[side]
        assert len(ranks) == 4 and min(ranks) > 0, mem
        # the step holds at least the unsharded parameters and their gradients
        assert peak >= 2 * unsharded > 0, mem
    assert "| 1F1B | 1f1b |" in r.stdout and "| 1f1b |" in r.stdout


def test_expert_parallel_stages_agree_with_torchs_dualpipev(tmp_path):
    """bench/peers/paired_ep.py: pp 2 x ep 2 (4 processes) of one Mixtral cut
    by split_model and spread by expert_parallel, torch's ScheduleDualPipeV
    against our dualpipev, plain and fb_overlap, step for step, under a
    modelled link (--link: HP_LINK in every rank, paying the expert
    all-to-alls of both sides and our pipeline transfers, PyTorch's sends
    through torch_link.py): the losses of every side agree (the script exits non-zero otherwise; checked here too)."""
    out = tmp_path / "paired_ep.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers", "paired_ep.py"),
                        "--rounds", "1", "--steps", "3", "--schedules", "DualPipeV",
                        "--fb-overlap", "--link", "100,10", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == []
    (run_,) = report["runs"]["DualPipeV"]
    assert run_["link"] == "100,10"  # what the ranks ran under
    # PyTorch's pipeline sends went through its link (torch_link.py) on every rank.
    assert all(n > 0 for n in run_["torch_link_sends"]), run_["torch_link_sends"]
    assert "link: 100 us, 10 GB/s" in r.stdout
    theirs = run_["torch"]["losses"]
    assert len(theirs) == 3
    for side in ("hp-py", "hp-overlap"):
        ours = run_[side]["losses"]
        assert len(ours) == 3, side
        for a, b in zip(theirs, ours):
            assert abs(a - b) <= 1e-4 * abs(a), (side, theirs, ours)
