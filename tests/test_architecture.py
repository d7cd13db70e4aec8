"""The package keeps the shape the README draws: layers imported only downwards, no import cycle
(function-level imports included), no private name taken from another module, and a README line
for every module."""

from __future__ import annotations

import ast
import graphlib
import pathlib
import re

import reshard

ROOT = pathlib.Path(reshard.__file__).parent
README = ROOT.parents[1] / "README.md"

# Each layer and the layers it may import. The flow is frameworks -> layout -> planning ->
# execution -> refit -> integrations -> apps, with modeling beside planning; lower layers never
# import higher ones.
BASE = {"errors", "tensors", "gc_pause", "quant"}
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "tensors": {"errors"},
    "gc_pause": set(),
    "forked": set(),  # one function in a forked child: the apps' second core
    "quant": {"errors"},  # block FP8 quantization: torch only
    "placements": {"tensors"},
    "layout_checks": BASE,  # a layout's validation, on plain data
    "piece_table": BASE,  # how a layout stores one tensor's pieces, as numpy arrays
    "layout": BASE | {"placements", "layout_checks", "piece_table"},
    "verify": BASE | {"layout"},
    "models": BASE,
    "frameworks": BASE | {"placements", "layout", "models"},
    "planning": BASE | {"placements", "layout"},
    "options": BASE | {"placements", "layout", "planning"},  # one validated value of a refit's options
    "modeling": BASE | {"placements", "layout", "planning", "options"},
    "execution": BASE | {"placements", "layout", "planning", "options"},
    "refit": BASE | {"placements", "layout", "models", "frameworks", "planning", "options", "execution"},
    "integrations": BASE | {"placements", "layout", "models", "frameworks", "planning", "options", "execution",
                            "refit"},
    "apps": BASE | {"placements", "layout", "verify", "models", "frameworks", "planning", "options", "modeling",
                    "execution", "forked",
                    "refit", "integrations"},
}
TOP = {"reshard", "reshard.__main__"}  # the package's public face may import anything


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("reshard",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        out[name] = path
    return out


MODULES = modules()


def layer(module: str) -> str:
    return module if module in TOP else module.split(".")[1]


def imports(module: str) -> list[tuple[str, str, str, int]]:
    """(imported module, imported name or '', local name, line) of every reshard import in ``module``, at
    any depth (function-level imports too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", a.asname or a.name, node.lineno) for a in node.names if a.name.startswith("reshard")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("reshard"):
                continue
            for a in node.names:
                sub, local = f"{target}.{a.name}", a.asname or a.name
                out.append((sub, "", local, node.lineno) if sub in MODULES else (target, a.name, local, node.lineno))
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_module_has_a_layer():
    assert {layer(m) for m in MODULES} <= set(LAYERS) | TOP, sorted({layer(m) for m in MODULES} - set(LAYERS) - TOP)


def test_layers_import_only_downwards():
    bad = []
    for m in MODULES:
        if m in TOP:
            continue
        for target, _, _, line in imports(m):
            if target not in MODULES:
                bad.append(f"{m}:{line} imports {target}, which does not exist")
            elif layer(target) != layer(m) and layer(target) not in LAYERS[layer(m)]:
                bad.append(f"{m}:{line} ({layer(m)}) imports {target} ({layer(target)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for t, _, _, _ in imports(m) if t in MODULES and t != m} for m in MODULES if m not in TOP}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_no_private_names_across_modules():
    bad = []
    for m in MODULES:
        found = imports(m)
        bad += [f"{m}:{line} imports {name} from {target}" for target, name, _, line in found
                if private(name) and target != m]
        as_module = {local for target, name, local, _ in found if not name and target != m}
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in as_module
                    and private(node.attr)):
                bad.append(f"{m}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_readme_architecture_names_every_module():
    text = README.read_text()
    section = text[text.index("## Architecture"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    named = set(re.findall(r"^\| `([a-z0-9_]+(?:/[a-z0-9_]+)*\.py)` \|", section, re.M))  # the table's first column
    files = {str(p.relative_to(ROOT)) for p in MODULES.values() if p.name not in ("__init__.py", "__main__.py")}
    assert files <= named, f"modules missing from the README's architecture section: {sorted(files - named)}"
    assert named <= files, f"the README's architecture section names modules that do not exist: {sorted(named - files)}"
