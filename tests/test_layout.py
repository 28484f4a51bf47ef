"""The layout says what depends on what: the library's modules import each other without cycles (lazy
imports inside functions included; `TYPE_CHECKING` imports are for annotations only), and the library
never imports the research scripts, the tests or the benchmark tooling."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere in its body, except under `if TYPE_CHECKING:`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    annotation_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in annotation_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def library_imports() -> dict[str, set[str]]:
    files = list((ROOT / "hf_bpd").rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, known) for f in files}


def test_library_modules_import_each_other_without_cycles():
    graph = library_imports()
    # packages re-export their modules (`hf_bpd/__init__.py`): a module importing its package is not a cycle
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_library_does_not_import_research_tests_or_benchmarks():
    for path in (ROOT / "hf_bpd").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in ("research", "tests", "benchmarks", "conftest"), (path, name)


def test_card_and_heads_import_in_one_direction():
    """heads.py imports card.py (its Hub folder's README.md); card.py imports nothing of the library, not even
    for annotations: it reads the heads through `heads.config` and `heads.save_pretrained` only."""
    known = {module_name(f) for f in (ROOT / "hf_bpd").rglob("*.py")}
    card = ast.parse((ROOT / "hf_bpd" / "card.py").read_text())
    relative = [node for node in ast.walk(card) if isinstance(node, ast.ImportFrom) and node.level]
    absolute = [
        alias.name
        for node in ast.walk(card)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in ([ast.alias(node.module or "")] if isinstance(node, ast.ImportFrom) else node.names)
    ]
    assert not relative and not [name for name in absolute if name in known or name == "hf_bpd"]
    assert "hf_bpd.card" in library_imports()["hf_bpd.drafting.heads"]


def test_model_cards_layout():
    """model_cards/ at the repository root: the card template and one card per head set shipped in the
    package (tests/test_card.py checks each is what its assets give); nothing is left in hf_bpd/templates/."""
    from hf_bpd.io.packaged import SHIPPED_ASSETS

    cards = ROOT / "model_cards"
    assert (cards / "template.md").is_file() and not list((ROOT / "hf_bpd").glob("templates/*"))
    shipped = [n for n, f in SHIPPED_ASSETS.items() if (ROOT / "hf_bpd" / f / "heads" / "config.json").is_file()]
    assert sorted(p.name for p in cards.iterdir()) == sorted(["template.md", *(f"{n}.md" for n in shipped)])


DECODE_LOOPS = {"hf_bpd.decode.row", "hf_bpd.decode.batch", "hf_bpd.decode.recurrent"}


def depends_on(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` imports, directly or through others (a package's `__init__` re-exports its
    modules: `from . import x` names the package, which is not a dependency on everything it re-exports)."""
    seen, todo = set(), [module]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen and not module.startswith(dep + "."):
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_decode_loops_share_the_call_and_the_cache_surgery_and_not_each_other():
    """One call context (`call.py`) and one place for cache surgery (`kv.py`) serve the three decode loops;
    no loop imports another, and neither the call, the cache surgery, the drafter nor the CPU kernels import a loop."""
    graph = library_imports()
    for loop in DECODE_LOOPS:
        assert {"hf_bpd.decode.call", "hf_bpd.kv"} <= depends_on(graph, loop), loop
    assert (
        "hf_bpd.decode.batch" not in graph["hf_bpd.decode.recurrent"]
        and "hf_bpd.decode.recurrent" not in graph["hf_bpd.decode.batch"]
    )
    for module in (
        "hf_bpd.decode.call",
        "hf_bpd.kv",
        "hf_bpd.drafting.drafter",
        "hf_bpd.cpu.packed_linear",
        "hf_bpd.cpu.streamed_linear",
    ):
        assert not DECODE_LOOPS & depends_on(graph, module), module
    assert depends_on(graph, "hf_bpd.kv") <= {"hf_bpd.compat"}  # the Cache API and its own tensors only


FOUNDATION = {f"hf_bpd.{m}" for m in ("compat", "log", "kv", "disk_cache", "machine_load", "card")}


def in_folder(module: str, folder: str) -> bool:
    return module.startswith(f"hf_bpd.{folder}.")


def test_the_folders_import_in_one_direction():
    """The folders say what depends on what: the foundation modules at the top (Cache API adapters, the
    on-disk measurement cache, logging, the cards) import no folder; the CPU kernels (`cpu/`) import only the
    foundation; drafting (`drafting/`) imports nothing of the decode side (`decode/`, `generation.py`): the
    drafter drafts, and its binding to a model (kernels, forward-cost curve) is the decode side's; `io/`
    (packaged models, the Hub, exports) is read by the tools and the users, never by the decode path or the
    drafting."""
    graph = library_imports()
    modules = set(graph)
    for module in FOUNDATION:
        assert depends_on(graph, module) <= FOUNDATION, module
    for module in (m for m in modules if in_folder(m, "cpu")):
        assert {d for d in depends_on(graph, module) if not in_folder(d, "cpu")} <= FOUNDATION, module
    for module in (m for m in modules if in_folder(m, "drafting")):
        decode = [d for d in depends_on(graph, module) if in_folder(d, "decode") or d == "hf_bpd.generation"]
        assert not decode, (module, decode)
    for module in (m for m in modules if in_folder(m, "drafting") or in_folder(m, "decode")):
        assert not [d for d in depends_on(graph, module) if in_folder(d, "io")], module


def test_research_scripts_import_only_public_names_of_the_bench():
    """The bench package (`hf_bpd/tools/bench/`) is a library the research scripts reuse: what they take from
    it (imported names, and attributes of the bench modules they import) has a public name, so the bench may
    change its private helpers without breaking them."""
    private = []
    for path in sorted((ROOT / "research").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to a bench module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_bpd.tools.bench"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                modules |= {a.asname or a.name for a in node.names}  # submodules, or names (harmless here)
            elif isinstance(node, ast.ImportFrom) and node.module == "hf_bpd.tools":
                modules |= {a.asname or a.name for a in node.names if a.name == "bench"}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("hf_bpd.tools.bench"):
                        private += [f"{path.name}: {a.name}"] * any(p.startswith("_") for p in a.name.split("."))
                        modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and ast.unparse(node.value) in modules:
                private.append(f"{path.name}: {ast.unparse(node)}")
    assert not private, private


def drafter_names(tree: ast.AST) -> set[str]:
    """The names a module gives the drafter: parameters and variables named `drafter` or annotated
    `BlockDrafter`, and whatever is assigned from a `.drafter` attribute (`call.drafter`)."""
    names = {"drafter"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and "BlockDrafter" in ast.unparse(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.Assign):
            pairs = (
                zip(node.targets[0].elts, node.value.elts)
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(node.targets[0], node.value)]
            )
            for target, value in pairs:
                if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "drafter":
                    names.add(target.id)
    return names


def test_the_decode_side_uses_no_private_drafter_attribute():
    """The loops, the call context and `generate` talk to the drafter through its documented interface
    (`BlockDrafter`'s docstring): no `drafter._name`, nor `call.drafter._name`, anywhere on the decode side."""
    files = [*(ROOT / "hf_bpd" / "decode").glob("*.py"), ROOT / "hf_bpd" / "generation.py"]
    for path in files:
        tree = ast.parse(path.read_text())
        names = drafter_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            is_drafter = (isinstance(owner, ast.Name) and owner.id in names) or (
                isinstance(owner, ast.Attribute) and owner.attr == "drafter"
            )
            assert not is_drafter, f"{path.name}:{node.lineno}: {ast.unparse(node)}"
