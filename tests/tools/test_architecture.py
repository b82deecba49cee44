"""The layering the architecture promises (docs/ARCHITECTURE.md), read from the source: every
import points down the layers, nothing outside the optimizers imports their private modules, no
module imports a module that imports it back, and no code below the optimizers' constructors
picks a backend by comparing its name (backends travel as objects)."""

from __future__ import annotations

import ast
from pathlib import Path

import onebit
from onebit.kernels import BACKENDS

SOURCE = Path(onebit.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SOURCE.rglob("*.py"):
        parts = ("onebit", *path.relative_to(SOURCE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The onebit modules ``name`` imports anywhere in its file (lazy imports too); an
    import of a name from a package counts as an import of that submodule if it is one."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    # A submodule's import of its own package (its __init__) is how Python loads it.
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def test_no_module_imports_a_module_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for target in sorted(graph[node]):
            if target == start:
                cycles.append(" -> ".join([*path, target]))
            elif target > start and target not in path:
                visit(start, target, [*path, target])

    for name in sorted(graph):
        visit(name, name, [name])
    assert cycles == []


def test_no_backend_is_selected_by_comparing_its_name():
    selector = SOURCE / "kernels" / "__init__.py"
    comparisons = []
    for path in SOURCE.rglob("*.py"):
        if path == selector:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in BACKENDS for o in operands):
                    comparisons.append(f"{path.relative_to(SOURCE)}:{node.lineno}")
    allowed = {"timing.py"}  # the benchmarks list the CPU backends to time
    assert [c for c in comparisons if c.split(":")[0] not in allowed] == []


#: The layers, bottom first, by the first part of each module's name below ``onebit``
#: (``onebit``: the package's own exports, at the adapters' level).
LAYERS = (
    ("maths", {"compression", "coefficients", "units", "atomic", "cache", "bert_shapes"}),
    ("kernels", {"kernels"}),
    ("exchange", {"exchange", "collectives", "consistency"}),
    ("optimizers", {"optim"}),
    (
        "adapters",
        {"ddp", "integrations", "deepspeed", "dcp", "clipping", "simulate", "timing", "diloco"}
        | {"plateau", "testing", "onebit"},
    ),
    ("applications", {"cli", "__main__", "train", "bench", "estimate"}),
)


def _layer(module: str) -> int:
    head = module.split(".")[1] if "." in module else module
    found = [index for index, (_, heads) in enumerate(LAYERS) if head in heads]
    assert found, f"{module} is in no layer of LAYERS: place it"
    return found[0]


def test_every_import_points_down_the_layers():
    modules = _modules()
    upward = [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
        for name, path in sorted(modules.items())
        for target in sorted(_imports(name, path, modules))
        if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_nothing_outside_the_optimizers_imports_their_private_modules():
    modules = _modules()
    private = [
        f"{name} imports {target}"
        for name, path in sorted(modules.items())
        if not name.startswith("onebit.optim")
        for target in sorted(_imports(name, path, modules))
        if target.startswith("onebit.optim._")
    ]
    assert private == []


def test_the_command_lists_every_command_with_one_line(monkeypatch):
    import argparse

    from onebit.cli import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {choice.dest: choice.help for choice in commands._choices_actions}
    assert set(listed) == set(commands.choices) >= {"train", "simulate", "study", "estimate"}
    lines = parser.format_help().splitlines()
    for name, help_text in listed.items():
        line = next(line for line in lines if line.strip().startswith(name + " "))
        assert help_text and line.rstrip().endswith(help_text), f"{name}: not on one line"
