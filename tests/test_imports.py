"""trjax's modules import one way: no cycle (counting imports inside functions) and the
rule between packages that ``trjax/__init__.py`` states:

* ``trjax.data`` and ``trjax.cpu`` import nothing else of trjax;
* the design modules at the top never import ``trjax.data`` or ``trjax.train``;
* nothing outside ``trjax.train`` imports ``trjax.train``;
* ``trjax.parallel`` (the layouts) imports the design modules below the step, never
  ``trjax.steps``, ``trjax.data`` or ``trjax.train``; only ``trjax.train`` imports it
  (the steps, the state, the plan, the exchange and the models read a layout's fields);
* the commands beside the trainer (``trjax.export``, ``trjax.tools``) sit on top: they
  may import any of trjax, and nothing of trjax imports them.
"""
import ast
import re
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trjax")


def module_files() -> dict[str, str]:
    """``{"trjax.data.augment": path, "trjax.steps": path, ...}`` (packages' ``__init__`` too)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        for f in filenames:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, ".."))
                name = rel[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def trjax_imports(path: str, modules: set[str]) -> set[str]:
    """The trjax modules ``path`` imports, at any depth of its code (``from trjax.data import
    augment`` counts as ``trjax.data.augment``; ``from trjax.world import World`` as
    ``trjax.world``)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("trjax.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == "trjax" or node.module.startswith("trjax.")):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out & modules


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {m: trjax_imports(p, set(files)) - {m} for m, p in files.items()}


COMMANDS = ("trjax.export", "trjax.tools")
"""The command modules on top of the rest (``trjax-export``, ``trjax-plot``, ...)."""


def package_of(module: str) -> str:
    """``"data"``, ``"cpu"``, ``"train"``, ``"parallel"``, ``"commands"`` (:data:`COMMANDS`)
    or ``"design"`` (a top-level module)."""
    if any(module == c or module.startswith(c + ".") for c in COMMANDS):
        return "commands"
    parts = module.split(".")
    packages = ("data", "cpu", "train", "parallel")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in packages) \
        else "design"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def rule_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        if m == "trjax":
            continue
        pkg = package_of(m)
        for d in sorted(deps):
            dpkg = package_of(d)
            if dpkg == "commands" and pkg != "commands":
                bad.append(f"{m} imports {d} (a command: nothing of trjax imports one)")
            if pkg == "commands":
                continue  # a command may import any of trjax
            if pkg in ("data", "cpu") and dpkg != pkg:
                bad.append(f"{m} ({pkg}/ imports nothing else of trjax) imports {d}")
            if pkg == "design" and dpkg in ("data", "train"):
                bad.append(f"{m} (a design module) imports {d}")
            if dpkg == "train" and pkg != "train":
                bad.append(f"{m} imports {d} (only trjax.train imports trjax.train)")
            if dpkg == "parallel" and pkg not in ("parallel", "train"):
                bad.append(f"{m} imports {d} (only trjax.train builds layouts; the design "
                           "reads their fields)")
            if pkg == "parallel" and (d == "trjax.steps" or dpkg in ("data", "train")):
                bad.append(f"{m} (a layout) imports {d}: the step calls the layout, not the "
                           "other way round")
    return bad


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_rule_checker_finds_each_kind_of_violation():
    graph = {"trjax.data.augment": {"trjax.world"}, "trjax.steps": {"trjax.data.prefetch"},
             "trjax.cpu.host": {"trjax.cpu.im2col"}, "trjax.report": {"trjax.train.loop"},
             "trjax.train.loop": {"trjax.steps", "trjax.data.prefetch", "trjax.cpu.host"}}
    # data -> design; design -> data; design -> train (two rules at once)
    assert len(rule_violations(graph)) == 4
    # a command imports anything; nothing imports a command
    commands = {"trjax.export": {"trjax.train.checkpoint", "trjax.data.input_pipeline"},
                "trjax.tools.plot": {"trjax.train.metrics_log"},
                "trjax.train.loop": {"trjax.tools.plot"}, "trjax.models": {"trjax.export"}}
    assert rule_violations(commands) == [
        "trjax.models imports trjax.export (a command: nothing of trjax imports one)",
        "trjax.train.loop imports trjax.tools.plot (a command: nothing of trjax imports one)"]
    layouts = {"trjax.parallel.pipeline": {"trjax.steps", "trjax.models"},
               "trjax.state": {"trjax.parallel.layout"},
               "trjax.train.trainer": {"trjax.parallel"}}
    # the pipeline above the step; the state building a layout; the trainer may
    assert len(rule_violations(layouts)) == 2


def test_the_graph_sees_every_package():
    graph = import_graph()
    assert {"trjax.steps", "trjax.exchange", "trjax.data.input_pipeline", "trjax.cpu.host",
            "trjax.train.loop", "trjax.train.config"} <= set(graph)
    assert "trjax.data.datasets" in graph["trjax.data.input_pipeline"]
    assert "trjax.steps" in graph["trjax.train.trainer"]
    assert "trjax.parallel.layout" in graph["trjax.parallel.pipeline"]


def test_no_import_cycle_between_trjax_modules():
    graph = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_import_rule_between_packages_holds():
    assert rule_violations(import_graph()) == []


def test_importing_the_models_loads_no_data_pipeline_and_no_pillow():
    code = ("import sys, trjax.models, trjax.steps, trjax.state; "
            "assert 'PIL' not in sys.modules, 'PIL'; "
            "assert not [m for m in sys.modules if m.startswith(('trjax.data', 'trjax.train'))]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.join(ROOT, ".."))


STRATEGY = re.compile(r'layout is (not )?None|tr\.stages|"stage" in|"model" in|bn_mode == "local"')


def test_only_the_layouts_decide_what_a_mesh_means():
    """What a mesh axis means is decided in ``trjax.parallel`` only; one library
    train-step factory (``steps.make_train_step``; the trainer's wrapper in ``train/``)."""
    found, factories = [], []
    for name, path in module_files().items():
        for i, line in enumerate(open(path), 1):
            if STRATEGY.search(line) and not name.startswith("trjax.parallel"):
                found.append(f"{name}:{i}: {line.strip()}")
            if line.startswith("def make_train_step"):
                factories.append(name)
    assert found == []
    assert sorted(factories) == ["trjax.steps", "trjax.train.trainer"]


STRATEGIES = {"trjax.parallel.tensor": "tensor", "trjax.parallel.fsdp": "fsdp",
              "trjax.parallel.pipeline": "pipeline", "trjax.parallel.stages": "pipeline",
              "trjax.parallel.schedules": "pipeline", "trjax.parallel.stage_owned": "pipeline",
              "trjax.parallel.zero_bubble": "pipeline"}
"""Each strategy of ``trjax.parallel`` and the modules that are its own."""


def strategy_violations(graph) -> list[str]:
    """No strategy imports another (only ``trjax.parallel.mesh`` composes them); the
    models import no parallelism."""
    bad = []
    for m, deps in graph.items():
        for d in deps:
            if m in STRATEGIES and d in STRATEGIES and STRATEGIES[m] != STRATEGIES[d]:
                bad.append(f"{m} ({STRATEGIES[m]}) imports {d} ({STRATEGIES[d]})")
            if m == "trjax.models" and d.startswith("trjax.parallel"):
                bad.append(f"trjax.models imports {d}")
    return sorted(bad)


def test_no_strategy_imports_another_and_the_models_import_no_parallelism():
    """Each parallel strategy adds its axis to a base layout (``layout(base, ...)``):
    they meet on the ground floor (layout, shards, mappings) and in ``mesh.py`` only."""
    assert strategy_violations({"trjax.parallel.fsdp": {"trjax.parallel.tensor"},
                                "trjax.parallel.pipeline": {"trjax.parallel.schedules"},
                                "trjax.models": {"trjax.parallel.mappings"}}) == [
        "trjax.models imports trjax.parallel.mappings",
        "trjax.parallel.fsdp (fsdp) imports trjax.parallel.tensor (tensor)"]
    graph = import_graph()
    assert set(STRATEGIES) <= set(graph)
    assert strategy_violations(graph) == []
    old = re.compile(r"tensor_axis|tensor_size|tensor_stages|tensor_head|split_model|"
                     r"shard_tree|base is None")
    found = [f"{name}:{i}" for name, path in module_files().items()
             for i, line in enumerate(open(path), 1) if old.search(line)]
    assert found == []
