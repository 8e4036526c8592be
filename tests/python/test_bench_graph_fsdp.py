"""bench/python/bench_graph_fsdp.py for one tiny round: graph-mode FSDP and
eager FSDP2 on 2 real processes take turns, train the same GPT to the same
losses, and the report has every column (its shape is checked, not speed);
bad arguments are refused before any process starts."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "python", "bench_graph_fsdp.py")


def run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_one_tiny_round_reports_every_column(tmp_path):
    out = tmp_path / "bench.json"
    r = run(["--rounds", "1", "--steps", "1", "--settings", "tiny", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())["settings"]
    assert set(report) == {"tiny/reshard=off", "tiny/reshard=on"}
    for name, s in report.items():
        sides = {"graph", "graph-no", "fsdp2"}
        assert set(s["median_ms"]) == sides and set(s["comm_ms"]) == sides, name
        assert s["steps"] == {side: 1 for side in sides}, name
        assert all(v > 0 for v in s["median_ms"].values()), name
        assert s["ratio"] == s["median_ms"]["graph"] / s["median_ms"]["fsdp2"]
        assert len(s["round_ratios"]) == 1
        assert s["round_ratio_median"] == s["round_ratios"][0]
        # Both graph sides block on their collectives somewhere; no overlap
        # means every wait right after its issue.
        assert s["comm_ms"]["graph-no"] > 0 and s["comm_ms"]["graph"] > 0, name
        assert s["hidden_share"] is not None and s["hidden_share"] < 1, name
        assert set(s["peak_mib"]) == {"graph", "fsdp2"}
        assert set(s["optimizer_ms"]) == sides
        assert all(0 < s["optimizer_ms"][side] < s["median_ms"][side] for side in sides), name
        assert all(v > 0 for v in s["peak_mib"].values()), name
        # warm-up + timed + memory step; the graph-no side has no memory step.
        assert len(s["losses"]["graph"]) == len(s["losses"]["fsdp2"]) == 3, name
        assert s["loss_max_rel_diff"] <= 1e-3, name
        assert s["losses"]["fsdp2"][-1] != s["losses"]["fsdp2"][0], "the model did not train"
    assert "graph FSDP (AutoOverlapPass) / eager FSDP2, paired" in r.stdout
    assert "tiny/reshard=on" in r.stdout


def test_bad_arguments_are_refused_before_any_run():
    for args, fragment in ((["--settings", "huge"], "--settings"),
                           (["--rounds", "0"], "--rounds")):
        r = run(args, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert fragment in r.stderr
