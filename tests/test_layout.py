"""The project's layout holds: each package imports only the layers below it (read from the
source, lazy imports included), the README's Layout section lists every package folder,
ruff lints every tracked Python file, and nothing refers to a design document outside the
repository."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verlite"
STDLIB = set(sys.stdlib_module_names)

# What each package folder may import besides the standard library and itself: third-party
# top-level modules, and verlite's own packages and top-level modules.
LAYERS: dict[str, tuple[set[str], set[str]]] = {
    # The math: torch only, nothing of verlite but core.
    "core": ({"torch"}, set()),
    # torch.distributed behind small functions; no Ray, nothing above it.
    "distributed": ({"torch"}, set()),
    # Ray: sessions, pools, worker groups, dispatch. No model code: no transformers, models,
    # rollout, workers, data or rewards.
    "controller": (
        {"ray", "tensordict", "torch"},
        {"config", "core", "distributed", "errors", "memory", "step_batch"},
    ),
    "models": ({"torch", "transformers"}, {"config"}),
    "rollout": ({"tensordict", "torch", "transformers"}, {"distributed", "errors"}),
    "workers": (
        {"tensordict", "torch"},
        {"config", "controller", "core", "distributed", "models", "rollout", "step_batch"},
    ),
    "data": (
        {"pyarrow", "tensordict", "tokenizers", "torch", "transformers"},
        {"config", "errors"},
    ),
    "rewards": (set(), {"config", "data", "errors"}),
    "config": ({"pydantic", "pydantic_core", "yaml"}, {"core", "errors", "yaml_files"}),
    "jobs": (
        {"aiohttp", "ray", "requests", "yaml"},
        {"", "config", "errors", "metrics_log", "tracking", "yaml_files"},
    ),
}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (``from verlite import x``
    counts as ``verlite.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "verlite":
                found.update(f"verlite.{alias.name}" for alias in node.names)
            elif node.module != "__future__":
                found.add(node.module)
    return found


def package_folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def test_every_package_folder_has_its_layer_rule() -> None:
    assert sorted(LAYERS) == package_folders()


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_package_imports_only_the_layers_below_it(package: str) -> None:
    third_party, own = LAYERS[package]
    problems = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for module in sorted(imports_of(path)):
            top, _, rest = module.partition(".")
            if top == "verlite":
                layer = rest.split(".")[0]
                if layer != package and layer not in own:
                    problems.append(f"{path.relative_to(ROOT)} imports {module}")
            elif top not in STDLIB and top not in third_party:
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


def test_the_rule_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    # The negative control: an import written in any of these forms is found.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import ray\nfrom verlite.models import build_policy\nfrom verlite import workers\n"
        "def later():\n    import transformers.models\n"
    )
    assert imports_of(probe) == {"ray", "verlite.models", "verlite.workers", "transformers.models"}


def test_the_readme_layout_lists_every_package_folder() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^  ([a-z_]+)/ ", section, flags=re.MULTILINE))
    assert listed == set(package_folders())
    modules = set(re.findall(r"^  ([a-z_]+)\.py ", section, flags=re.MULTILINE))
    assert modules == {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}


def test_no_package_folder_is_named_like_a_build_output() -> None:
    # ruff and the usual .gitignore skip these names: code in them would go unlinted or
    # unshipped (Ray's packager follows .gitignore).
    skipped = {"dist", "build", "site-packages", "node_modules", "venv", "_build"}
    assert not [
        p for p in ROOT.rglob("*") if p.is_dir() and p.name in skipped and ".venv" not in p.parts
    ]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ruff_lints_every_tracked_python_file() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    linted = {
        str(Path(line).resolve().relative_to(ROOT)) for line in listed if line.endswith(".py")
    }
    assert sorted(set(tracked) - linted) == []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_nothing_refers_to_a_design_document_outside_the_repository() -> None:
    found = subprocess.run(
        [
            "git",
            "grep",
            "-nE",
            r"shared/DESIGN|DESIGN(\.md)? ?§",
            "--",
            ".",
            ":!tests/test_layout.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert found == ""
    assert (ROOT / "docs" / "design.md").is_file()
    assert "docs/design.md" in (ROOT / "README.md").read_text()
