"""The house a reader walks into: the top level holds the lesson and nothing else, the
machinery lives in one package whose modules import each other without a cycle and share no
private names, and the README's file tree lists every file there is."""

import ast
import os
import re
import subprocess
import sys

from conftest import REPO

LESSON = {"train_dp.py", "train_ddp.py", "train_fsdp.py", "train_tp.py", "model.py", "data.py"}
TOP_LEVEL = LESSON | {"README.md", "requirements.txt", "requirements-dev.txt", "pytest.ini", ".gitignore", ".ci",
                      "ops", "training", "tools", "benchmarks", "tests", "docs", "slurm"}
FOLDERS = ("ops", "training", "tools", "benchmarks")
SUBFOLDERS = ("training/stream",)  # a package within a folder: its files listed under it


def tracked_top_level() -> set:
    """What a clone holds at the top (git's list: a run's out/ or a virtualenv is not the project)."""
    if (REPO / ".git").exists():
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        return {line.split("/")[0] for line in files.splitlines()}
    return {name for name in os.listdir(REPO) if name not in ("__pycache__", ".pytest_cache", "out")}


def project_modules() -> dict:
    """Every Python module of the project (tests aside), by import name: path."""
    modules = {path.stem: path for path in REPO.glob("*.py")}
    for folder in FOLDERS:
        modules.update({f"{folder}.{path.stem}": path for path in (REPO / folder).glob("*.py")
                        if path.stem != "__init__"})
    return modules


def imports_of(path, modules: dict) -> list[tuple[str, str]]:
    """(module, name) for every project import in the file, at any depth (a function's too):
    `from training import x` is module training.x; `from training.x import y`, (training.x, y)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    found.append((f"{node.module}.{alias.name}", ""))
                elif node.module in modules:
                    found.append((node.module, alias.name))
    return found


def test_the_top_level_holds_the_lesson_and_nothing_a_learner_must_skip():
    assert tracked_top_level() == TOP_LEVEL
    assert LESSON <= {path.name for path in REPO.glob("*.py")}


def test_no_module_imports_itself_back_through_others():
    modules = project_modules()
    graph = {name: {m for m, _ in imports_of(path, modules)} for name, path in modules.items()}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            cycle = on_path[on_path.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        on_path.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert graph["training.checkpoint"].isdisjoint({"training.pt_checkpoint", "training.sharded_checkpoint"})
    assert "training.sharded_checkpoint" not in graph["training.pt_checkpoint"]  # siblings over one base
    assert "training.pt_checkpoint" not in graph["training.sharded_checkpoint"]
    # the model stands on its own operators (ops/), never on what the scripts share (training/)
    assert not [m for m in graph["model"] | graph["ops.packed_attention"] | graph["ops.chunked_loss"]
                if m.startswith("training.")]


def test_data_py_imports_nothing_of_the_machinery():
    """The data's arrows run one way: the machinery (training/) calls data.py, the lesson's
    file, never the reverse, neither directly nor through a module data.py imports. Read from
    the source (every import, a function's too), and seen in a fresh process."""
    modules = project_modules()
    graph = {name: {m for m, _ in imports_of(path, modules)} for name, path in modules.items()}
    reached, todo = set(), ["data"]
    while todo:
        new = graph[todo.pop()] - reached
        reached |= new
        todo += sorted(new)
    assert sorted(m for m in reached if m.startswith("training.")) == []
    program = "import sys, data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'training'))"
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_private_name_crosses_a_module():
    modules = project_modules()
    crossing = []
    for name, path in modules.items():
        text = path.read_text()
        crossing += [f"{name} imports {m}.{n}" for m, n in imports_of(path, modules) if n.startswith("_")]
        imported = {m.rsplit(".", 1)[-1] for m, n in imports_of(path, modules) if not n}
        crossing += [f"{name} uses {m}" for m in re.findall(r"(?<![\w.])(\w+\._[a-z]\w*)", text)
                     if m.split(".")[0] in imported]
    assert crossing == []


def test_every_module_imports_alone():
    """Each module in a fresh set of project modules (torch stays loaded): none relies on
    another having been imported first."""
    names = sorted(project_modules())
    program = f"""
import importlib, sys
sys.path.insert(0, {str(REPO)!r})
import torch, datasets, tokenizers  # the slow ones, once
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {sorted({n.split(".")[0] for n in names})!r}]:
        del sys.modules[loaded]
    importlib.import_module(name)
print("imported", len({names!r}))
"""
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["imported", str(len(names))]


def test_the_readme_tree_has_a_line_for_every_file():
    readme = (REPO / "README.md").read_text()
    tree = readme[readme.index("## The files, in reading order"):]
    tree = tree[tree.index("```\n") + 4:]
    tree = tree[:tree.index("\n```")]
    listed, folders = [], []  # folders: the path of each indentation level's folder, two spaces a level
    for line in tree.splitlines():
        entry, _, purpose = line.strip().partition(" ")
        assert purpose.strip(), f"no purpose given for {entry}"
        depth = (len(line) - len(line.lstrip())) // 2
        del folders[depth:]
        listed.append("/".join([*folders, entry.rstrip("/")]))
        if entry.endswith("/"):
            folders.append(entry.rstrip("/"))
    for folder in [*FOLDERS, *SUBFOLDERS]:
        on_disk = {f"{folder}/{path.name}" for path in (REPO / folder).glob("*.py") if path.name != "__init__.py"}
        listed_here = {entry for entry in listed if entry.startswith(f"{folder}/") and entry.endswith(".py")
                       and "/" not in entry[len(folder) + 1:]}
        assert on_disk == listed_here, folder
    assert LESSON <= set(listed)


def test_the_tp_rung_is_a_small_diff_over_fsdp_and_the_readme_gives_its_size():
    """`diff train_fsdp.py train_tp.py` teaches the fourth rung alone: at most 90 changed lines
    (issue #66's bound), the figure the README's rung section gives."""
    shown = subprocess.run(["diff", "train_fsdp.py", "train_tp.py"], cwd=REPO, capture_output=True, text=True).stdout
    changed = sum(line.startswith(("<", ">")) for line in shown.splitlines())
    assert changed <= 90
    assert f"`diff train_fsdp.py train_tp.py` ({changed} changed lines)" in (REPO / "README.md").read_text()
