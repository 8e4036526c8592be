"""Shared pytest setup: the package under test and helpers for multi-process tests."""

import os
import sys

# The package lives in python/ of the work tree (scripts/setup_python.sh also
# puts it on the environment's path); tests also run from a bare checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
