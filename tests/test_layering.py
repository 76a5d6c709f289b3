"""The package layering of docs/architecture.md, checked against the code: every import of a
pocketllm module (at module level or inside a function) points to its own layer or one below, no
two packages import each other, and no module imports another module's private names."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pocketllm"


def layers() -> dict[str, int]:
    """Package (or top-level module) -> its layer, from the table under '## Layers' in the doc."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rank = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                rank[name] = int(m.group(1))
    return rank


def unit(module: str) -> str:
    """The layering's unit of a module: its package under pocketllm, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> list[tuple[str, str, list[str], str]]:
    """(importing module, imported module, imported names, 'file:line') for every pocketllm import."""
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if f.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            where = f"{f.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [(module, a.name, [], where) for a in node.names if a.name.startswith("pocketllm")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("pocketllm"):
                    continue
                folder = PACKAGE.parent / target.replace(".", "/")
                subs = [a.name for a in node.names
                        if (folder / f"{a.name}.py").exists() or (folder / a.name / "__init__.py").exists()]
                found += [(module, f"{target}.{name}", [], where) for name in subs]  # `from pkg import module`
                names = [a.name for a in node.names if a.name not in subs]
                if names:
                    found.append((module, target, names, where))
    return found


def test_every_package_has_a_layer():
    rank = layers()
    units = {unit(".".join(f.relative_to(ROOT).with_suffix("").parts)) for f in PACKAGE.glob("*.py")}
    units |= {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").exists()}
    assert units - set(rank) == set(), "place these in the table of docs/architecture.md"
    assert set(rank) - units == set(), "the table names packages that are gone"


def test_imports_point_down():
    rank = layers()
    up = [f"{where}: {unit(src)} (layer {rank[unit(src)]}) imports {dst} (layer {rank[unit(dst)]})"
          for src, dst, _, where in imports() if rank[unit(dst)] > rank[unit(src)]]
    assert up == []


def test_no_two_packages_import_each_other():
    edges = {(unit(s), unit(d)) for s, d, _, _ in imports() if unit(s) != unit(d)}
    assert sorted((a, b) for a, b in edges if (b, a) in edges and a < b) == []


def test_no_private_names_cross_modules():
    """A module's underscore names are its own; what another module needs is public (or moves)."""
    private = [f"{where}: {', '.join(n for n in names if n.startswith('_'))} from {dst}"
               for src, dst, names, where in imports()
               if dst != src and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert private == []


def test_every_import_names_a_module_that_exists():
    """(A module moved between packages leaves no import of its old place behind.)"""
    def exists(module: str) -> bool:
        path = PACKAGE.parent / module.replace(".", "/")
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    assert [f"{where}: {dst}" for _, dst, _, where in imports() if not exists(dst)] == []


def test_models_and_layers_ask_no_tensor_its_device():
    """Models and layers name operations; the platform's kernels are chosen once, before the model is
    built (kernels/platform.py), not by asking a tensor or a device where it is."""
    asks = re.compile(r"\.is_cuda\b|\.is_cpu\b|device\.type\b|\.type\s*==\s*[\"'](cuda|cpu)[\"']|is_available\(\)")
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
             for folder in ("models", "layers") for f in sorted((PACKAGE / folder).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []
