#!/usr/bin/env python3
"""The fault-injection suite: every case of cases.tsv (beside this file) run
as a shell command in a fresh folder, checked for its exit status, the first
line of its output and the time it took; one line per case, then
"N passed, N failed". Exit status 1 when a case failed.

    .venv/bin/python tests/faults/run_faults.py --hp build/tools/hp/hp [--only NAME,...]
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def read_cases(path):
    cases = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 5:
                sys.exit(f"{path}:{n}: a case has 5 tab-separated fields, this line has {len(parts)}")
            name, command, code, phrase, bound = parts
            cases.append((name, command, int(code), phrase, float(bound)))
    return cases


def run_case(case, hp, py):
    """(passed, what happened)."""
    name, command, code, phrase, bound = case
    tmp = tempfile.mkdtemp(prefix=f"hp-fault-{name}-")
    try:
        if "{tmp}/full" in command:
            try:
                os.mknod(os.path.join(tmp, "full"), 0o666 | 0o020000, os.makedev(1, 7))
            except PermissionError:
                return None, "NOT TESTED here: mknod of a full device needs root"
        cmd = command
        for key, value in (("{hp}", hp), ("{py}", py), ("{root}", ROOT), ("{tmp}", tmp)):
            cmd = cmd.replace(key, shlex.quote(value))
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-c", cmd], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                               timeout=bound + 30, cwd=tmp)
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired:
            return False, f"still running after {bound + 30:.0f} s (bound {bound:.0f} s)"
        seconds = time.monotonic() - t0
        first = out.splitlines()[0] if out.strip() else ""
        problems = []
        if rc != code:
            problems.append(f"exit {rc}, expected {code}")
        if phrase == "-" and first:
            problems.append(f"printed {first!r}, expected nothing")
        if phrase != "-" and phrase not in first:
            problems.append(f"first line {first!r} lacks {phrase!r}")
        if seconds > bound:
            problems.append(f"took {seconds:.1f} s, bound {bound:.0f} s")
        return not problems, "; ".join(problems) or f"{seconds:.1f} s"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hp", default=os.path.join(ROOT, "build", "tools", "hp", "hp"))
    ap.add_argument("--py", default=sys.executable)
    ap.add_argument("--cases", default=os.path.join(HERE, "cases.tsv"))
    ap.add_argument("--only", default="", help="comma-separated case names")
    a = ap.parse_args(argv)
    if not os.access(a.hp, os.X_OK):
        ap.error(f"--hp: '{a.hp}' is not an executable (build it: bash scripts/build.sh)")
    cases = read_cases(a.cases)
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {c[0] for c in cases}
        if unknown:
            ap.error(f"--only: no case named {sorted(unknown)}")
        cases = [c for c in cases if c[0] in wanted]
    passed = failed = skipped = 0
    for case in cases:
        ok, what = run_case(case, os.path.abspath(a.hp), a.py)
        mark = "SKIP" if ok is None else "ok" if ok else "FAIL"
        print(f"{mark:4} {case[0]}: {what}", flush=True)
        passed += ok is True
        failed += ok is False
        skipped += ok is None
    print(f"faults: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
