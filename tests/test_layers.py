"""The package's layers, as docs/architecture.md states them, hold in the
source: every import of a kimi_jax module (at module level or inside a
function) points to the importer's own layer or one below it, and no chain
of imports leads back to where it started."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def read_layers(markdown: str) -> list[tuple[str, tuple[str, ...]]]:
  """The fenced ```layers block: one line per layer, bottom first, its name
  then the packages and modules in it."""
  m = re.search(r"```layers\n(.*?)```", markdown, re.S)
  if m is None:
    raise AssertionError(f"{ARCHITECTURE}: no ```layers block")
  layers = []
  for line in m.group(1).splitlines():
    line = line.split("#", 1)[0].split()
    if line:
      layers.append((line[0], tuple(line[1:])))
  return layers


def module_names(package_dir: str) -> dict[str, str]:
  """Dotted module name -> source path, for every module of the package."""
  names = {}
  top = os.path.dirname(package_dir)
  for dirpath, _, files in os.walk(package_dir):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
        names[rel.removesuffix(".__init__")] = path
  return names


def imported_modules(name: str, path: str, modules: dict[str, str]
                     ) -> set[str]:
  """The package modules that `name` imports anywhere in its source. A
  `from pkg import x` counts as importing pkg.x when x is a module."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = name.split(".")[:len(name.split(".")) - node.level +
                                   (1 if is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                 else base for a in node.names]
    else:
      continue
    for t in targets:
      while t and t not in modules:
        t = t.rpartition(".")[0]
      if t and t != name:
        out.add(t)
  return out


def import_graph(package_dir: str) -> dict[str, set[str]]:
  modules = module_names(package_dir)
  return {name: imported_modules(name, path, modules)
          for name, path in modules.items()}


def layer_of(module: str, layers) -> int:
  """The layer whose member is the longest dotted prefix of `module`."""
  best, best_len = None, -1
  for i, (_, members) in enumerate(layers):
    for m in members:
      if (module == m or module.startswith(m + ".")) and len(m) > best_len:
        best, best_len = i, len(m)
  if best is None:
    raise AssertionError(f"{module} is in no layer of {ARCHITECTURE}: add "
                         f"it to the ```layers block")
  return best


def upward_edges(graph, layers) -> list[str]:
  out = []
  for src, dsts in sorted(graph.items()):
    for dst in sorted(dsts):
      a, b = layer_of(src, layers), layer_of(dst, layers)
      if b > a:
        out.append(f"{src} ({layers[a][0]}) imports {dst} ({layers[b][0]})")
  return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, comps = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return comps


@pytest.fixture(scope="module")
def layers():
  with open(ARCHITECTURE) as f:
    return read_layers(f.read())


@pytest.fixture(scope="module")
def graph():
  return import_graph(os.path.join(ROOT, "kimi_jax"))


def test_no_import_goes_up_a_layer(layers, graph):
  up = upward_edges(graph, layers)
  assert not up, ("imports that point up the layers of docs/architecture.md "
                  "(move the shared piece down, or pass it in):\n  " +
                  "\n  ".join(up))


def test_no_import_cycle(graph):
  found = cycles(graph)
  assert not found, "import cycles:\n  " + "\n  ".join(
      " <-> ".join(c) for c in found)


def test_the_checks_catch_what_they_are_for(tmp_path):
  """On a made-up package: an upward import and a cycle are both found."""
  pkg = tmp_path / "pkg"
  (pkg / "low").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "low" / "__init__.py").write_text("")
  (pkg / "low" / "a.py").write_text("def f():\n  from pkg import high\n")
  (pkg / "low" / "b.py").write_text("from pkg.low import a\n")
  (pkg / "high.py").write_text("from pkg.low import b\n")
  g = import_graph(str(pkg))
  spec = [("low", ("pkg.low", "pkg")), ("high", ("pkg.high",))]
  assert upward_edges(g, spec) == ["pkg.low.a (low) imports pkg.high (high)"]
  assert cycles(g) == [["pkg.high", "pkg.low.a", "pkg.low.b"]]
  g["pkg.low.a"].discard("pkg.high")
  assert upward_edges(g, spec) == [] and cycles(g) == []


def in_function_imports(package_dir: str) -> list[tuple[str, int, str]]:
  """(path, line, text) of every package import inside a function or class
  body: the usual sign of a dodged cycle."""
  out = []
  for name, path in sorted(module_names(package_dir).items()):
    with open(path) as f:
      source = f.read()
    tree = ast.parse(source, path)
    top = {id(n) for n in tree.body}
    lines = source.splitlines()
    package = os.path.basename(package_dir)
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names])
        if getattr(node, "level", 0) or any(
            n.split(".")[0] == package for n in names):
          out.append((path, node.lineno, lines[node.end_lineno - 1]))
  return out


def test_few_in_function_imports_each_with_its_reason():
  """At most 15, and each says on its line why it cannot sit at the top
  (an optional heavy dependency, say)."""
  found = in_function_imports(os.path.join(ROOT, "kimi_jax"))
  assert len(found) <= 15, f"{len(found)} in-function imports of kimi_jax"
  silent = [f"{p}:{n}" for p, n, text in found if "#" not in text]
  assert not silent, ("in-function imports without a `# reason` comment:\n  "
                      + "\n  ".join(silent))


def test_in_function_imports_are_found(tmp_path):
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("import os\n\ndef f():\n  from pkg import b\n"
                            "  import json\n")
  (pkg / "b.py").write_text("class C:\n  def g(self):\n"
                            "    from . import a  # the reason\n")
  found = in_function_imports(str(pkg))
  assert [(os.path.basename(p), n, t.strip()) for p, n, t in found] == [
      ("a.py", 4, "from pkg import b"),
      ("b.py", 3, "from . import a  # the reason")]


def test_every_module_has_a_layer(layers, graph):
  for module in graph:
    layer_of(module, layers)
