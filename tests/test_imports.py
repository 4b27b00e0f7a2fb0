"""The trjax modules import one way (no import cycle, counting imports inside functions), as
the README's concepts diagram draws them; no module grows past about 400 lines."""
import ast
import os
import re


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trjax")


def trjax_imports(path: str) -> set[str]:
    """Names of the trjax modules ``path`` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names
                    if a.name.startswith("trjax.") and a.name.count(".") >= 1}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "trjax":
                out |= {a.name for a in node.names}
            elif node.module.startswith("trjax."):
                out.add(node.module.split(".")[1])
    return out


def import_graph() -> dict[str, set[str]]:
    mods = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f != "__init__.py"}
    return {m: trjax_imports(os.path.join(ROOT, m + ".py")) & mods for m in mods}


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


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_trjax_modules():
    graph = import_graph()
    assert {"steps", "exchange", "state", "aot", "plan", "config"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_core_modules_do_not_reach_back_to_the_loop():
    graph = import_graph()
    for m in ("steps", "exchange", "state", "aot", "plan", "regions", "metrics", "collectives",
              "allreduce", "compression", "optim"):
        assert not graph[m] & {"train", "config", "report", "checkpoint"}, (m, graph[m])
    assert "train" not in graph["report"]  # the report takes a built trainer


def test_data_modules_import_one_way():
    """Sources (datasets, formats, imagefolder) feed the pipeline, never the reverse."""
    graph = import_graph()
    for source in ("datasets", "formats", "imagefolder"):
        assert not graph[source] & {"input_pipeline", "augment"}, (source, graph[source])
    assert "datasets" in graph["input_pipeline"]


README = os.path.join(ROOT, "..", "README.md")


def readme_rows() -> list[list[str]]:
    """The module rows of the README's concepts diagram ("imports, one way"),
    top to bottom; words in parentheses are descriptions, not modules."""
    lines = open(README).read().split("\n")
    start = next(i for i, line in enumerate(lines) if "imports, one way" in line) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.sub(r"\([^)]*\)", " ", line).split())
    return rows


def test_readme_concepts_diagram_matches_the_import_graph():
    graph = import_graph()
    rows = readme_rows()
    listed = [m for row in rows for m in row]
    assert sorted(listed) == sorted(graph), (
        f"README rows list {sorted(set(listed) - set(graph))} that are not trjax modules and "
        f"miss {sorted(set(graph) - set(listed))}; duplicates: "
        f"{sorted({m for m in listed if listed.count(m) > 1})}")
    assert not misplaced(graph, rows), misplaced(graph, rows)


def misplaced(graph: dict[str, set[str]], rows: list[list[str]]) -> dict[str, list[str]]:
    """{module: the modules it imports from its own row or a row below}."""
    row_of = {m: i for i, row in enumerate(rows) for m in row}
    wrong = {m: sorted(d for d in graph[m] if row_of[d] >= row_of[m]) for m in graph}
    return {m: d for m, d in wrong.items() if d}


def test_the_diagram_check_sees_a_module_in_the_wrong_row():
    graph = {"a": set(), "b": {"a"}, "c": {"a"}}
    assert misplaced(graph, [["a"], ["b", "c"]]) == {}
    assert misplaced(graph, [["b"], ["a"], ["c"]]) == {"b": ["a"]}
    assert misplaced(graph, [["a", "c"], ["b"]]) == {"c": ["a"]}  # same row: not above


def test_no_trjax_module_is_over_400_lines():
    sizes = {f: sum(1 for _ in open(os.path.join(ROOT, f))) for f in os.listdir(ROOT)
             if f.endswith(".py")}
    assert max(sizes.values()) <= 400, {f: n for f, n in sizes.items() if n > 400}
