"""The dependency direction of docs/ARCHITECTURE.md: lower layers never import higher ones, at module level or
inside a function, and every package imports on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What each part of the code may import from this repository (prefixes of module names); anything else of ours is a
# layering violation. Third-party modules are free. Ordered bottom-up, as in docs/ARCHITECTURE.md.
ALLOWED = {
    "diff_transformer": (),  # the package itself: empty
    "diff_transformer.fileio": (),
    "diff_transformer.cli": (),  # the exit statuses and one-line errors every entry point shares
    "diff_transformer.attention_metrics": (),  # plain-tensor metrics: torch only
    "diff_transformer.figure_style": (),  # one colour per attention kind in every figure: stdlib only
    "kernels": ("kernels", "diff_transformer.fileio"),
    "diff_transformer.compat": (),
    "diff_transformer.distributed": ("diff_transformer.compat",),
    "data": ("data", "diff_transformer.fileio", "diff_transformer.cli"),
    "diff_transformer.models": (
        "diff_transformer.models", "kernels", "diff_transformer.distributed", "diff_transformer.compat",
    ),
    "diff_transformer.config": ("data.config", "diff_transformer.models"),
    "diff_transformer.training": (
        "diff_transformer.training", "diff_transformer.models", "diff_transformer.config", "diff_transformer.compat",
        "diff_transformer.distributed", "diff_transformer.fileio", "data", "diff_transformer.attention_metrics",
        "diff_transformer.figure_style",  # the progress line's token counts read as the figures' do (1.2M)
    ),
    # checkpoints loaded for inference, perplexity, NIAH, the attention analysis, their figures
    "diff_transformer.evaluation": (
        "diff_transformer.evaluation", "diff_transformer.training", "diff_transformer.models",
        "diff_transformer.config", "diff_transformer.distributed", "diff_transformer.fileio", "data",
        "diff_transformer.attention_metrics", "diff_transformer.figure_style",
    ),
    # engine=deepspeed: the trainer's subclass; it reads no config schema or data module of its own
    "diff_transformer.training.deepspeed_engine": (
        "diff_transformer.training", "diff_transformer.models", "diff_transformer.compat",
        "diff_transformer.distributed", "diff_transformer.fileio",
    ),
    "diff_transformer.analysis": ("diff_transformer.analysis", "diff_transformer.figure_style"),
    # Hugging Face interchange: reads and writes checkpoints, so above training
    "diff_transformer.hf": (
        "diff_transformer.hf", "diff_transformer.training", "diff_transformer.models", "diff_transformer.config",
        "diff_transformer.compat", "diff_transformer.distributed", "diff_transformer.fileio", "data",
    ),
    # command-line entry points over the libraries
    # (every entry point may check its output with the torch-free fileio before it imports a library)
    "diff_transformer.checkpoint": ("diff_transformer.training", "diff_transformer.cli", "diff_transformer.fileio"),
    "diff_transformer.compare": ("diff_transformer.analysis", "diff_transformer.cli", "diff_transformer.fileio"),
    # the quickstart's A/B trains both models in its own process (training.paired_throughput)
    "diff_transformer.quickstart": ("diff_transformer.analysis", "diff_transformer.fileio", "diff_transformer.cli",
                                    "diff_transformer.figure_style", "diff_transformer.training.paired_throughput"),
    # export refuses a path that is no checkpoint before it imports torch: the torch-free checkpoint layout
    "diff_transformer.export": ("diff_transformer.hf", "diff_transformer.training.checkpoint_files", "diff_transformer.cli",
                                "diff_transformer.fileio"),
    "diff_transformer.import_hf": ("diff_transformer.hf", "diff_transformer.cli", "diff_transformer.fileio"),
    # evaluate reports each checkpoint's peak memory with the trainer's measurement (training.accounting)
    "diff_transformer.evaluate": ("diff_transformer.evaluation", "diff_transformer.distributed",
                                  "diff_transformer.training.accounting", "diff_transformer.cli",
                                  "diff_transformer.fileio"),
    "diff_transformer.analyze": ("diff_transformer.evaluation", "diff_transformer.distributed",
                                 "diff_transformer.evaluate", "diff_transformer.cli"),
    # the job's config, the memory plan train.py runs (refused at submission), data.preprocess's command line and
    # partitions (the job array), the tokenizer's vocabulary (the plan's logits)
    "launch": ("launch", "diff_transformer.config", "diff_transformer.training.accounting", "data",
               "diff_transformer.cli"),
    "train": ("diff_transformer.config", "diff_transformer.distributed", "diff_transformer.training",
              "diff_transformer.cli"),
}
OURS = ("diff_transformer", "kernels", "data", "launch", "train")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    return max((key for key in ALLOWED if module == key or module.startswith(key + ".")), key=len)


def imported_modules(path: Path):
    """(line, module) of every import in the file, including those inside functions."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def reachable(layer: str) -> tuple:
    """``layer`` and every prefix it may import, directly or through the layers it imports."""
    visited, prefixes, todo = set(), {layer}, [layer]
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        prefixes |= set(ALLOWED[current])
        todo += [layer_of(a) for a in ALLOWED[current]]
    return tuple(prefixes)


def source_files():
    files = [REPO / "train.py"]
    for top in ("diff_transformer", "kernels", "data", "launch"):
        files += sorted((REPO / top).rglob("*.py"))
    return [f for f in files if "corpus" not in f.parts]


def test_lower_layers_never_import_higher_ones():
    violations = []
    for path in source_files():
        layer = layer_of(module_name(path))
        for line, target in imported_modules(path):
            if target.split(".")[0] not in OURS:
                continue
            allowed = ALLOWED[layer]
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                violations.append(f"{path.relative_to(REPO)}:{line} ({layer}) imports {target}")
    assert violations == []


def import_graph():
    """{module: the modules of ours it imports} (``from pkg import name`` counts as importing pkg.name when that is a
    module, otherwise pkg), over every import statement including those inside functions."""
    modules = {module_name(path): path for path in source_files()}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, target in imported_modules(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def import_cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_another_that_imports_it_back():
    """No two modules of ours import each other, directly or through others (a cycle inside one package counts)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle_inside_a_package():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


# Optional heavy dependencies and the only modules that may import them (inside functions, at export/import time):
# training never loads them.
OPTIONAL_IMPORTERS = {"transformers": ("diff_transformer.hf.export",), "safetensors": ("diff_transformer.hf.importer",)}


def test_transformers_is_imported_only_by_the_export_and_import_code():
    violations = []
    for path in source_files():
        module = module_name(path)
        for line, target in imported_modules(path):
            top = target.split(".")[0]
            if top in OPTIONAL_IMPORTERS and module not in OPTIONAL_IMPORTERS[top]:
                violations.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert violations == []


def test_training_does_not_load_transformers():
    code = "import sys, train, diff_transformer.training.trainer; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", out.stderr[-3000:]


@pytest.mark.parametrize("package", ["diff_transformer.fileio", "diff_transformer.attention_metrics", "kernels", "data",
                                     "diff_transformer.compat", "diff_transformer.distributed", "diff_transformer.models",
                                     "diff_transformer.analysis", "diff_transformer.hf", "diff_transformer.evaluation"])
def test_each_package_imports_alone_without_higher_layers(package):
    """Import every module of ``package`` in a fresh interpreter; no module of a layer above it gets loaded."""
    root = REPO / package.replace(".", "/")
    modules = [module_name(p) for p in sorted(root.rglob("*.py"))] if root.is_dir() else [package]
    modules = [m for m in modules if "corpus" not in m and not m.endswith("check_compile")]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{OURS!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    allowed = reachable(package)
    loaded = [m for m in out.stdout.split() if m != "diff_transformer"]  # the namespace package itself is empty
    assert [m for m in loaded if not any(m == a or m.startswith(a + ".") for a in allowed)] == []
