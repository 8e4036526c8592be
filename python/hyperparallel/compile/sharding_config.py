"""PassPlan: which modules FSDP shards, by exact FQN or fnmatch pattern, and
its YAML form (seed 002 §4.2).

Torch-free. Lookup is the C++ `hp::compile::PassPlan`'s: the exact FQN first,
then the first pattern in insertion order that matches (fnmatch, case
sensitive; `*` also matches '.'). The YAML is read by the C++ reader
(yaml-cpp, hp/compile/pass_config.cpp) through `hyperparallel._C.compile`, so
Python and `hp train --graph` accept and refuse the same files with the same
messages.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["FSDPModuleConfig", "PassPlan", "create_sharding_plan_from_yaml"]


@dataclass(frozen=True)
class FSDPModuleConfig:
    """What FSDP does with one planned module. Only the name / pattern is read
    from YAML (the seed removed the fields no pass consumed)."""

    key: str


class PassPlan:
    """Two registries: exact module FQNs and fnmatch patterns, each in
    insertion order; `enabled` is explicit or "anything registered"."""

    def __init__(self, modules: Iterable[str] = (), patterns: Iterable[str] = (),
                 enabled: Optional[bool] = None):
        self._modules: Dict[str, FSDPModuleConfig] = {}
        self._patterns: Dict[str, FSDPModuleConfig] = {}
        self._enabled: Optional[bool] = None
        for m in modules:
            self.add_module(m)
        for p in patterns:
            self.add_pattern(p)
        if enabled is not None:
            self.set_enabled(enabled)

    # -- building --------------------------------------------------------
    def add_module(self, fqn: str) -> "PassPlan":
        """Registers (or replaces, keeping its place) an exact module FQN."""
        self._modules[_key(fqn, "module")] = FSDPModuleConfig(fqn)
        return self

    def add_pattern(self, pattern: str) -> "PassPlan":
        """Registers (or replaces, keeping its place) an fnmatch pattern."""
        self._patterns[_key(pattern, "pattern")] = FSDPModuleConfig(pattern)
        return self

    def set_enabled(self, on: bool) -> "PassPlan":
        if not isinstance(on, bool):
            raise ValueError(f"PassPlan: enabled must be True or False, not {on!r}")
        self._enabled = on
        return self

    # -- reading ---------------------------------------------------------
    @property
    def fsdp_modules(self) -> Dict[str, FSDPModuleConfig]:
        return dict(self._modules)

    @property
    def fsdp_patterns(self) -> Dict[str, FSDPModuleConfig]:
        return dict(self._patterns)

    @property
    def enabled(self) -> bool:
        """The explicit `fsdp.enabled`, else "any module or pattern registered"."""
        if self._enabled is not None:
            return self._enabled
        return bool(self._modules or self._patterns)

    @property
    def explicit_enabled(self) -> Optional[bool]:
        return self._enabled

    def lookup(self, module_fqn: str) -> Optional[FSDPModuleConfig]:
        """The exact entry for `module_fqn`, else the first matching pattern."""
        if module_fqn in self._modules:
            return self._modules[module_fqn]
        for pattern, config in self._patterns.items():
            if fnmatch.fnmatchcase(module_fqn, pattern):
                return config
        return None

    def covers_parameter(self, param_fqn: str) -> bool:
        """True when a module owning `param_fqn` (a proper prefix "a", "a.b" of
        "a.b.weight") or the parameter itself is planned."""
        parts = param_fqn.split(".")
        for i in range(1, len(parts)):
            if self.lookup(".".join(parts[:i])) is not None:
                return True
        return self.lookup(param_fqn) is not None

    def merge(self, other: "PassPlan") -> "PassPlan":
        """A new plan: this plan's entries, then `other`'s; `other` wins on
        equal keys (keeping the first one's place) and on an explicit
        `enabled`. Neither plan changes."""
        out = PassPlan()
        out._modules = {**self._modules, **other._modules}
        out._patterns = {**self._patterns, **other._patterns}
        out._enabled = other._enabled if other._enabled is not None else self._enabled
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PassPlan):
            return NotImplemented
        return (list(self._modules) == list(other._modules)
                and list(self._patterns) == list(other._patterns)
                and self.enabled == other.enabled)

    def __repr__(self) -> str:
        return (f"PassPlan(modules={list(self._modules)}, patterns={list(self._patterns)}, "
                f"enabled={self.enabled})")

    # -- YAML ------------------------------------------------------------
    @classmethod
    def from_yaml(cls, text: str, source: str = "<yaml>") -> "PassPlan":
        """Parses the seed's YAML (`fsdp: {enabled, modules: [{name}], patterns:
        [{pattern}]}`) with the C++ reader; ValueError naming `source` and the line."""
        return cls._from_parsed(_binding("parse_pass_plan_yaml")(text, source))

    @classmethod
    def load_yaml(cls, path: str) -> "PassPlan":
        """Reads (a regular file of at most 1 MiB) and parses a YAML plan."""
        return cls._from_parsed(_binding("load_pass_plan_yaml")(str(path)))

    @classmethod
    def _from_parsed(cls, parsed: Tuple[Optional[bool], List[str], List[str]]) -> "PassPlan":
        enabled, modules, patterns = parsed
        return cls(modules, patterns, enabled)

    def to_yaml(self) -> str:
        """The YAML that from_yaml reads back to an equal plan (JSON strings are
        YAML double-quoted scalars)."""
        lines = ["fsdp:", f"  enabled: {'true' if self.enabled else 'false'}"]
        lines.append("  modules:" + ("" if self._modules else " []"))
        lines += [f"    - name: {json.dumps(k)}" for k in self._modules]
        lines.append("  patterns:" + ("" if self._patterns else " []"))
        lines += [f"    - pattern: {json.dumps(k)}" for k in self._patterns]
        return "\n".join(lines) + "\n"

    def save_yaml(self, path: str) -> None:
        with open(path, "w", encoding="ascii") as f:
            f.write(self.to_yaml())


def create_sharding_plan_from_yaml(path: str) -> PassPlan:
    """The seed's entry point: the PassPlan of a YAML file (see PassPlan.load_yaml)."""
    return PassPlan.load_yaml(path)


def _key(key: str, what: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"PassPlan: a {what} must be a non-empty string, not {key!r}")
    if any(not (0x20 <= ord(c) <= 0x7E) for c in key):
        raise ValueError(f"PassPlan: {what} {key!r} holds a character that is not printable "
                         "ASCII; module names and patterns are printable ASCII")
    return key


def _binding(name: str):
    """hyperparallel._C.compile.<name>, or an ImportError saying why it is missing."""
    try:
        from .. import _C
        return getattr(_C.compile, name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"reading a PassPlan from YAML needs hyperparallel._C.compile.{name} (the C++ "
            "reader, hp/compile/pass_config.cpp, through yaml-cpp), which this build of the "
            "extension lacks (an HP_EXTENSION_ONLY build has no hp/compile): rebuild with "
            "`bash scripts/build.sh`, or build the plan in Python: "
            "PassPlan().add_module('...').add_pattern('...')") from e
