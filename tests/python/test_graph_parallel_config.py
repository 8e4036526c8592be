"""PassConfig and PassPlan (seed 002 §4): defaults and validate(), exact
before patterns in insertion order, merge (other wins, inputs untouched),
and the YAML contract through the C++ reader (hyperparallel._C.compile):
the seed's file, round trips, malformed files naming the line."""

import pytest

from hyperparallel.compile import PassConfig, PassPlan, create_sharding_plan_from_yaml


def test_pass_config_defaults_and_validate():
    c = PassConfig()
    assert (c.enable_overlap, c.fsdp_enabled, c.fsdp_degree, c.tp_size) == (True, True, None, 1)
    assert (c.sequence_parallel, c.loss_parallel, c.reshard_after_forward) == (False,) * 3
    assert c.backend is None
    c.validate()
    with pytest.raises(ValueError, match="tp_size is 0"):
        PassConfig(tp_size=0).validate()
    with pytest.raises(ValueError, match="fsdp_degree is 0"):
        PassConfig(fsdp_degree=0).validate()
    with pytest.raises(ValueError, match="fsdp_degree is 2.5"):
        PassConfig(fsdp_degree=2.5).validate()
    with pytest.raises(ValueError, match="enable_overlap is 'yes'"):
        PassConfig(enable_overlap="yes").validate()
    with pytest.raises(ValueError, match="prefetch is 0"):
        PassConfig(prefetch=0).validate()
    PassConfig(fsdp_degree=4, tp_size=2, backend="inductor", prefetch=None).validate()


def test_parallel_config_module_is_torch_free():
    import ast
    import hyperparallel.compile.parallel_config as pc
    import hyperparallel.compile.sharding_config as sc
    import hyperparallel.compile.passes.base as base
    import hyperparallel.compile.passes.pipeline as pipe

    for mod in (pc, sc, base, pipe):
        tree = ast.parse(open(mod.__file__).read())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top for a in n.names] + [
            n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(x.split(".")[0] == "torch" for x in names), mod.__name__


def test_plan_exact_first_then_patterns_in_insertion_order():
    plan = PassPlan().add_pattern("layers.*").add_pattern("layers.1*").add_module("layers.1")
    assert plan.lookup("layers.1").key == "layers.1"    # exact wins
    assert plan.lookup("layers.10").key == "layers.*"   # first pattern wins
    assert plan.lookup("head") is None
    assert plan.covers_parameter("layers.3.fc.weight")
    assert not plan.covers_parameter("head.weight")
    assert not plan.covers_parameter("layers")  # a root parameter has no owning module
    assert plan.enabled and not PassPlan().enabled
    assert PassPlan(["a"], enabled=False).enabled is False
    with pytest.raises(ValueError, match="non-empty string"):
        PassPlan().add_module("")


def test_plan_merge_other_wins_without_modifying():
    a = PassPlan().add_module("tok").add_pattern("layers.*")
    b = PassPlan().add_module("head").add_pattern("layers.*").add_pattern("blocks.?")
    b.set_enabled(False)
    m = a.merge(b)
    assert list(m.fsdp_modules) == ["tok", "head"]
    assert list(m.fsdp_patterns) == ["layers.*", "blocks.?"]  # kept its place
    assert m.enabled is False  # other's explicit flag wins
    assert a.enabled and list(a.fsdp_modules) == ["tok"] and list(b.fsdp_modules) == ["head"]
    assert a.merge(PassPlan()).enabled  # an implicit flag does not win


# -- YAML: the C++ reader, bound -----------------------------------------

def _has_reader():
    try:
        from hyperparallel import _C
        return hasattr(getattr(_C, "compile", None), "parse_pass_plan_yaml")
    except ImportError:
        return False


yaml_reader = pytest.mark.skipif(not _has_reader(), reason=(
    "hyperparallel._C.compile.parse_pass_plan_yaml is not in this build of the extension"))

SEED_YAML = """fsdp:
  enabled: true
  modules:
    - name: tok_embeddings
  patterns:
    - pattern: "layers.*"
"""


@yaml_reader
def test_yaml_of_the_seed_and_round_trip(tmp_path):
    p = PassPlan.from_yaml(SEED_YAML)
    assert list(p.fsdp_modules) == ["tok_embeddings"]
    assert list(p.fsdp_patterns) == ["layers.*"]
    assert p.enabled and p.explicit_enabled is True
    path = tmp_path / "plan.yaml"
    path.write_text(SEED_YAML)
    assert create_sharding_plan_from_yaml(str(path)) == p
    q = PassPlan().add_module("a.b").add_pattern("layers.[0-3]*").set_enabled(False)
    q.save_yaml(str(tmp_path / "q.yaml"))
    assert create_sharding_plan_from_yaml(str(tmp_path / "q.yaml")) == q
    assert PassPlan.from_yaml(PassPlan().to_yaml()) == PassPlan()
    # enabled defaults to "anything registered"
    assert PassPlan.from_yaml("fsdp:\n  modules:\n    - name: a\n").enabled
    assert PassPlan.from_yaml("fsdp:\n  modules:\n    - name: a\n").explicit_enabled is None
    assert not PassPlan.from_yaml("fsdp:\n  modules: []\n").enabled
    assert not PassPlan.from_yaml("").enabled


@yaml_reader
@pytest.mark.parametrize("text, message", [  # the cases of tests/compile/test_config.cpp
    ("fsdp:\n  modules:\n    - [name: a\n", "malformed YAML"),
    ("fsdp:\n  modules:\n    - name: a\n    - nome: b\n", "plan.yaml line 4"),
    ("fsdp:\n  patterns: \"layers.*\"\n", "plan.yaml line 2"),
    ("fsdp:\n  enabled: true\n  reshard_after_forward: true\n", "line 3: unknown key "
     "'fsdp.reshard_after_forward'"),
    ("fsdp:\n  enabled: maybe\n", "line 2: fsdp.enabled must be true or false"),
    ("a[[b # c\n,\n", "line 2: a ',' outside [ ], { } and quotes"),
    ("%aY: .a [x\nfsdp: [[x]]\n", "line 1: a directive"),
    ("fsdp:\n  enabled: 'a\n,b'\n", "line 2: a quoted scalar that goes on past its line"),
    ("fsdp:\n  patterns: [a,\n    b]\n", "not closed on its line"),
    ("- a\n- b\n", "line 1"),
    ("fdsp:\n  enabled: true\n", "plan.yaml line 1: unknown key 'fdsp' (known: fsdp)"),
    ("fsdp:\n  enabled: true\nextra: 1\n", "line 3: unknown key 'extra'"),
    ("fsdp:\n  enabled: true\n  enabled: false\n",
     "line 3: duplicate key 'enabled' (first on line 2)"),
    ("fsdp:\n  modules:\n    - name: a\n---\nfsdp: {}\n", "line 4: a second YAML document"),
    ("fsdp:\n  patterns:\n    - pattern: a.*\n      reshard: true\n",
     "line 4: unknown key 'reshard' in an fsdp.patterns entry"),
    ("fsdp:\n  modules:\n    - name: \"a\\tb\"\n", "not printable ASCII"),
    ("a: &a [x, *a]\n", "nested deeper than"),
])
def test_malformed_yaml_names_the_line(text, message):
    with pytest.raises(ValueError) as e:
        PassPlan.from_yaml(text, "plan.yaml")
    assert message in str(e.value)


@yaml_reader
def test_yaml_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        create_sharding_plan_from_yaml(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="not a regular file"):
        create_sharding_plan_from_yaml(str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("fsdp:\n  modules:\n    - nam: a\n")
    with pytest.raises(ValueError, match="more than the limit"):
        PassPlan.from_yaml("#" * ((1 << 20) + 1), "big.yaml")
    with pytest.raises(ValueError, match=r"bad\.yaml line 3"):
        create_sharding_plan_from_yaml(str(bad))


def test_without_the_reader_the_error_says_what_to_do(monkeypatch):
    from hyperparallel.compile import sharding_config

    class NoCompile:
        pass

    import hyperparallel
    monkeypatch.setattr(hyperparallel, "_C", NoCompile(), raising=False)
    with pytest.raises(ImportError, match="parse_pass_plan_yaml"):
        PassPlan.from_yaml(SEED_YAML)
    assert sharding_config  # the module stays importable without the reader
