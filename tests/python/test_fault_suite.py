"""The fault-injection suite (tests/faults/cases.tsv, run by
tests/faults/run_faults.py): each case's exit status, first line and time
bound, with the hp tool this tree built."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_fault_case_ends_as_expected_within_its_bound():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "faults", "run_faults.py")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout
    assert " 0 failed" in p.stdout.splitlines()[-1], p.stdout
