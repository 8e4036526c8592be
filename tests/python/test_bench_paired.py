"""bench/peers/paired.py as the benchmark runs it: 2 real processes hold
PyTorch's pipelining and our Python runtime side by side over two Gloo groups
and take turns step by step; both train the same GPT from the same values on
the same batches, so their losses must agree step for step (float32, the
tolerance the benchmark itself applies), and bad arguments are refused."""

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
