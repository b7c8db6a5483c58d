"""Structural rules of the package, enforced: the comm layer owns torch.distributed; the public API is stable."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import zeroshard

PACKAGE = Path(zeroshard.__file__).parent
DIST_IMPORT = re.compile(r"^\s*(import torch\.distributed|from torch\.distributed|from torch import distributed)", re.M)


def test_only_comm_imports_torch_distributed():
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if DIST_IMPORT.search(p.read_text()) and p.relative_to(PACKAGE).parts[0] != "comm"
    ]
    assert offenders == []


def test_no_bare_asserts_in_library_code():
    offenders = [
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if re.search(r"^\s*assert\s", p.read_text(), re.M)
    ]
    assert offenders == []


def test_public_api_surface():
    assert set(zeroshard.__all__) >= {
        "initialize",
        "add_config_arguments",
        "init_distributed",
        "comm",
        "init_inference",
    }
    assert callable(zeroshard.comm.log_summary)
    engine_api = {
        "backward",
        "step",
        "is_gradient_accumulation_boundary",
        "zero_grad",
        "was_step_applied",
        "get_lr",
        "get_global_grad_norm",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization_stage",
        "destroy",
        "save_checkpoint",
        "load_checkpoint",
        "train",
        "eval",
    }
    assert engine_api <= set(dir(zeroshard.ZeroshardEngine))


def test_add_config_arguments():
    import argparse

    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json"]).deepspeed_config == "a.json"
    args = parser.parse_args(["--zeroshard", "--zeroshard_config", "b.json"])
    assert args.deepspeed and args.deepspeed_config == "b.json"


DESIGN = PACKAGE.parent / "docs" / "design.md"
TOP_LEVEL = {"__init__", "__main__", "__version__"}  # the public API imports what it exposes


def layer_table(design: str) -> dict[str, set[str]]:
    """``docs/design.md``'s layer table: package -> the zeroshard packages it may import."""
    section = design.split("## Layers", 1)[1].split("\n### ", 1)[0]
    allowed = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            allowed[cells[0].strip("`/")] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return allowed


def _top_level(root: Path, name: str) -> tuple[list[str], list[str]]:
    """``from zeroshard import name``: a package or module of that name, or a name of the public API (``__init__``)."""
    return ([name], []) if (root / name).is_dir() or (root / f"{name}.py").is_file() else (["__init__"], [name])


def imports_by_package(root: Path) -> list[tuple[str, str, str, str, list[str]]]:
    """Every import of one zeroshard package from another: (importer, imported, file, module, names taken)."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        here = rel.parts[0].removesuffix(".py")
        package = list(rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[tuple[list[str], list[str]]] = []
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                module = base + (node.module.split(".") if node.module else [])
                names = [a.name for a in node.names]
                targets = [(module, names)] if module else [_top_level(root, n) for n in names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == root.name:
                module = node.module.split(".")[1:]  # `from zeroshard import comm` names the package itself
                names = [a.name for a in node.names]
                targets = [(module, names)] if module else [_top_level(root, n) for n in names]
            elif isinstance(node, ast.Import):
                targets = [
                    (a.name.split(".")[1:] or ["runtime"], []) for a in node.names if a.name.split(".")[0] == root.name
                ]
            for module, names in targets:
                if not module or module[0] == here:
                    continue
                found.append((here, module[0], str(rel), ".".join(module), names))
    return found


def layer_violations(root: Path, allowed: dict[str, set[str]]) -> list[str]:
    problems = []
    for here, there, where, module, names in imports_by_package(root):
        if here in TOP_LEVEL or there in TOP_LEVEL:
            continue
        private = [n for n in [*module.split("."), *names] if n.startswith("_") and not n.endswith("__")]
        if here not in allowed:
            problems.append(f"{where}: package '{here}' is not in the layer table")
        elif there not in allowed[here]:
            problems.append(f"{where}: '{here}' imports '{there}' ({module}), above it or not listed")
        elif private:
            problems.append(f"{where}: imports the private name {private[0]} of '{there}'")
    return sorted(set(problems))


def test_packages_import_only_the_layers_design_md_allows():
    allowed = layer_table(DESIGN.read_text())
    assert {"comm", "zero", "runtime", "checkpoint", "inference", "log"} <= set(allowed)
    assert "runtime" not in allowed["checkpoint"] and "runtime" not in allowed["inference"]
    assert layer_violations(PACKAGE, allowed) == []


def test_the_layer_table_is_as_strict_as_the_code():
    """Each row names exactly the packages its package imports: a row that allows more than the code uses would let
    a new upward-looking import pass unnoticed."""
    allowed = layer_table(DESIGN.read_text())
    used: dict[str, set[str]] = {name: set() for name in allowed}
    for here, there, *_ in imports_by_package(PACKAGE):
        if here not in TOP_LEVEL and there not in TOP_LEVEL:
            used.setdefault(here, set()).add(there)
    slack = {name: sorted(allowed[name] - used[name]) for name in allowed if allowed[name] - used[name]}
    assert slack == {}


def test_the_layer_check_finds_an_upward_and_a_private_import(tmp_path):
    root = tmp_path / "zeroshard"
    for package, text in {
        "checkpoint": "from ..runtime.log import log_rank0\n",
        "inference": "from ..zero.init import _helper\n",
        "runtime": "from zeroshard.zero import ZeroStack\n",
        "lightning": "def f():\n    from zeroshard import comm\n",  # the package by its absolute name, in a function
    }.items():
        (root / package).mkdir(parents=True)
        (root / package / "a.py").write_text(text)
    (root / "comm").mkdir()
    (root / "__init__.py").write_text("from .runtime.a import initialize\n")
    (root / "compat.py").write_text("from zeroshard import initialize\n")  # the public API: allowed everywhere
    allowed = {"checkpoint": set(), "inference": {"zero"}, "runtime": {"zero"}, "zero": set(), "lightning": set()}
    allowed["compat"] = set()
    assert layer_violations(root, allowed) == [
        "checkpoint/a.py: 'checkpoint' imports 'runtime' (runtime.log), above it or not listed",
        "inference/a.py: imports the private name _helper of 'zero'",
        "lightning/a.py: 'lightning' imports 'comm' (comm), above it or not listed",
    ]


def module_graph(root: Path) -> dict[str, set[str]]:
    """Which file imports which, function-local imports included (those under ``if TYPE_CHECKING`` aside); a name
    taken from a package's ``__init__`` counts as an import of the file that defines it (followed through the
    package's own re-exports)."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = []
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}  # fmt: skip
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                for alias in node.names:
                    whole = f"{module}.{alias.name}"
                    edges.append((name, whole if whole in files else module, None if whole in files else alias.name))
            elif isinstance(node, ast.Import):
                edges += [(name, alias.name, None) for alias in node.names]
    exports = {(src, taken): dst for src, dst, taken in edges if taken and files.get(src, Path()).name == "__init__.py"}

    def defined_in(module: str, taken) -> str:
        for _ in range(10):
            if (module, taken) not in exports:
                break
            module = exports[(module, taken)]
        return module

    graph: dict[str, set[str]] = {name: set() for name in files if files[name].name != "__init__.py"}
    for src, dst, taken in edges:
        dst = defined_in(dst, taken)
        if src in graph and dst in graph and dst != src:
            graph[src].add(dst)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_two_files_import_each_other_even_inside_a_function():
    assert import_cycles(module_graph(PACKAGE)) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_and_a_package(tmp_path):
    root = tmp_path / "zeroshard"
    (root / "optim").mkdir(parents=True)
    (root / "optim" / "__init__.py").write_text("from .muon import Muon\n")
    (root / "optim" / "muon.py").write_text("from .contract import Needs\nclass Muon: ...\n")
    (root / "optim" / "contract.py").write_text(
        "def adopt():\n    from zeroshard.optim import Muon\nclass Needs: ...\n"
    )
    (root / "optim" / "lion.py").write_text("from . import contract\n")
    assert import_cycles(module_graph(root)) == [["zeroshard.optim.contract", "zeroshard.optim.muon"]]


def test_importing_zeroshard_configures_no_logging():
    code = (
        "import logging; before = (logging.root.handlers[:], logging.root.level); import zeroshard, zeroshard.compat; "
        "lib = logging.getLogger('zeroshard'); "
        "assert (logging.root.handlers, logging.root.level) == before; "
        "assert [type(h).__name__ for h in lib.handlers] == ['NullHandler'], lib.handlers; "
        "assert lib.level == logging.NOTSET and lib.propagate; print('clean')"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr


def test_the_launcher_starts_without_importing_torch():
    """``import zeroshard`` is lazy and the launcher imports no torch: only torchrun's agent and the ranks pay for it
    (every launch, restart and ``zeroshard --help``)."""
    code = "import sys, zeroshard.launcher.cli; print([m for m in ('torch', 'pydantic') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_functions_stay_short():
    """A function that grew past 60 lines usually holds a second concept: at most 5 may, none past 80 (issue 54
    split 16 such; this keeps them split)."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append((lines, f"{path.relative_to(PACKAGE)}:{node.name}"))
    assert len(long) <= 5 and all(lines <= 80 for lines, _ in long), sorted(long, reverse=True)
