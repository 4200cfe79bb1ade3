"""The project's layout holds: every import in the source obeys the README's Layout table
(lazy and relative imports included), the README lists every module, the set-up's install
imports from anywhere, ruff lints every tracked Python file, and nothing refers to a design document outside the repository."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verlite"
STDLIB = set(sys.stdlib_module_names)


@dataclass(frozen=True)
class Layer:
    """One row of the README's Layout table: what a package folder (or module) may import."""

    third_party: frozenset[str]
    banned: frozenset[str]  # submodules of an allowed package that stay out: "torch (not ...)"
    own: frozenset[str]  # verlite's packages and top-level modules


def _names(cell: str) -> tuple[set[str], set[str]]:
    allowed, banned = set(), set()
    for item in cell.split(","):
        name, _, rest = item.strip().partition(" (not ")
        if name not in ("", "-"):
            allowed.add(name.strip())
        if rest:
            banned.add(rest.rstrip(")").strip())
    return allowed, banned


def readme_layers() -> dict[str, Layer]:
    """The Layout table of README.md, by folder or module name."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `([a-z_]+)(?:/|\.py)` \|[^|]*\|([^|]*)\|([^|]*)\|$", section, re.MULTILINE
    )
    layers = {}
    for name, third_party, own in rows:
        allowed, banned = _names(third_party)
        layers[name] = Layer(frozenset(allowed), frozenset(banned), frozenset(_names(own)[0]))
    return layers


LAYERS = readme_layers()


def package_folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def imports_of(text: str, package: str) -> set[str]:
    """Every module a file of ``package`` (dotted) imports, at the top or inside a function:
    ``from verlite import x`` counts as ``verlite.x``, a relative import as the module it
    names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            if base == "verlite":
                found.update(f"verlite.{alias.name}" for alias in node.names)
            elif base != "__future__":
                found.add(base)
    return found


def forbidden(module: str, name: str, layer: Layer) -> bool:
    """Whether ``name``'s row forbids importing ``module``."""
    top, _, rest = module.partition(".")
    if top == "verlite":
        return rest.split(".")[0] not in (name, *layer.own)
    if any(module == b or module.startswith(b + ".") for b in layer.banned):
        return True
    return top not in STDLIB and top not in layer.third_party


def violations(name: str, layer: Layer) -> list[str]:
    """The imports of ``name`` (a package folder or a top-level module) its row forbids."""
    folder = PACKAGE / name
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]
    problems = []
    for path in files:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for module in sorted(imports_of(path.read_text(), package)):
            if forbidden(module, name, layer):
                problems.append(f"{path.relative_to(ROOT)} imports {module}")
    return problems


def test_every_package_folder_has_its_row_and_the_rows_say_what_matters() -> None:
    folders = {name for name in LAYERS if (PACKAGE / name).is_dir()}
    assert sorted(folders) == package_folders()
    assert LAYERS["core"].third_party == {"torch"} and "torch.distributed" in LAYERS["core"].banned
    assert not LAYERS["core"].own
    assert "ray" not in LAYERS["distributed"].third_party
    assert "transformers" not in LAYERS["controller"].third_party
    assert not {"models", "generation", "workers", "data", "rewards"} & LAYERS["controller"].own


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_package_imports_only_what_its_row_allows(name: str) -> None:
    problems = violations(name, LAYERS[name])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("core", "import torch.distributed as dist\n"),
        ("core", "from torch.distributed import all_reduce\n"),
        ("core", "from ..controller import WorkerGroup\n"),
        ("distributed", "def later():\n    import ray\n"),
        ("controller", "from verlite.models import build_policy\n"),
        ("controller", "from verlite import workers\n"),
        ("controller", "import transformers\n"),
    ],
)
def test_the_rule_check_finds_a_forbidden_import(name: str, text: str) -> None:
    # The negative control: code that breaks a row is caught, in every import form.
    found = imports_of(text, f"verlite.{name}")
    assert any(forbidden(module, name, LAYERS[name]) for module in found), found


def test_the_readme_layout_lists_every_module() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    modules = set(re.findall(r"^  ([a-z_]+)\.py ", section, flags=re.MULTILINE))
    assert modules == {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}


def test_no_package_folder_is_named_like_a_build_output() -> None:
    # ruff and the usual .gitignore skip these names: code in them would go unlinted or
    # unshipped (Ray's packager follows .gitignore).
    skipped = {"dist", "build", "site-packages", "node_modules", "venv", "_build"}
    assert not [
        p for p in ROOT.rglob("*") if p.is_dir() and p.name in skipped and ".venv" not in p.parts
    ]


def test_python_in_the_folder_that_holds_the_checkout_imports_verlite(tmp_path: Path) -> None:
    # The checkout named verlite beside where Python starts (a notebook in ~ over ~/verlite):
    # an empty namespace package by that name, found before the editable install's finder.
    (tmp_path / "verlite").symlink_to(ROOT, target_is_directory=True)
    imported = subprocess.run(
        [sys.executable, "-c", "import verlite; print(verlite.__file__, verlite.load_config)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(str(ROOT / "verlite" / "__init__.py"))


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
            # written in two pieces so this line is not itself such a reference
            "shared/" + r"DESIGN|DESIGN(\.md)? ?§",
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
