"""The package loads against the torch it was built for, and refuses any other
torch with an ImportError that names both versions and the fix."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hyperparallel
from hyperparallel import _build_info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_built_against_this_torch():
    assert hyperparallel._C.torch_version().split("+")[0] == torch.__version__.split("+")[0]
    assert _build_info.torch_version.split("+")[0] == torch.__version__.split("+")[0]


def test_pinned_version_is_the_one_in_requirements():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = [line.strip() for line in f if line.startswith("torch==")]
    assert pins == [f"torch=={_build_info.torch_pinned}"]


def test_another_torch_is_a_clear_import_error(tmp_path):
    # A stand-in torch of another version, first on the path: importing the
    # package must fail in Python, before the extension is loaded.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.10.0+cpu"\n')
    code = textwrap.dedent(
        """
        import sys
        try:
            import hyperparallel
        except ImportError as e:
            print("IMPORT-ERROR:", e)
            print("C loaded:", "hyperparallel._C" in sys.modules)
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.path.join(ROOT, 'python')}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout, out.stdout + out.stderr
    assert "2.10.0+cpu" in out.stdout and _build_info.torch_version in out.stdout
    assert f"pip install torch=={_build_info.torch_version.split('+')[0]}" in out.stdout
    assert "C loaded: False" in out.stdout


def test_check_torch_version_accepts_local_builds_of_the_same_release():
    hyperparallel.check_torch_version("2.11.0+cu130", "2.11.0")
    with pytest.raises(ImportError, match="built against torch 2.11.0"):
        hyperparallel.check_torch_version("2.12.0", "2.11.0")
