"""The import graph of the project's modules: no loop, and no import against
the layering experiments -> moe_jax.train -> moe_jax.eval -> moe_jax.model
-> moe_jax.layers -> pallas_kernels (docs/design.md §2).

Read from the source with ast (nothing is imported), every import counted,
those inside functions too.
"""
import ast
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("experiments", "moe_jax", "pallas_kernels")
# Left to right; a module may import only layers at or right of its own.
_LAYERS = ("experiments", "moe_jax.train", "moe_jax.eval", "moe_jax.model",
           "moe_jax.layers", "pallas_kernels")


def _modules():
  """{module name: path} of every .py file in the packages."""
  out = {}
  for pkg in _PACKAGES:
    for root, _, files in os.walk(os.path.join(_ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(root, f), _ROOT)[:-3]
          name = rel.replace(os.sep, ".")
          out[name.removesuffix(".__init__")] = os.path.join(root, f)
  return out


def _imports(path, name, modules):
  """The project modules `path` imports (a `from package import module`
  counts as the module)."""
  tree = ast.parse(open(path).read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = name.split(".")
        pkg = parts if path.endswith("__init__.py") else parts[:-1]
        base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base
                                                            else []))
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for t in targets:
      if t in modules:
        found.add(t)
      elif t.rsplit(".", 1)[0] in modules and not any(
          t == m for m in modules):
        found.add(t.rsplit(".", 1)[0])
  found.discard(name)
  return found


@pytest.fixture(scope="module")
def graph():
  modules = _modules()
  return {name: _imports(path, name, modules)
          for name, path in modules.items()}


def _layer(name):
  for i, layer in enumerate(_LAYERS):
    if name == layer or name.startswith(layer + "."):
      return i
  return None


def test_no_import_loop(graph):
  # A module importing its own package's __init__ is not a loop of code
  # (the package's __init__ imports its submodules by name).
  edges = {m: {t for t in ts if not m.startswith(t + ".")}
           for m, ts in graph.items()}
  state, path = {}, []

  def visit(m):
    state[m] = "open"
    path.append(m)
    for t in sorted(edges.get(m, ())):
      if state.get(t) == "open":
        loop = path[path.index(t):] + [t]
        raise AssertionError("import loop: " + " -> ".join(loop))
      if t not in state:
        visit(t)
    path.pop()
    state[m] = "done"

  for m in sorted(edges):
    if m not in state:
      visit(m)


def test_no_import_against_the_layering(graph):
  bad = [(m, t) for m, ts in graph.items() for t in ts
         if _layer(m) is not None and _layer(t) is not None
         and _layer(t) < _layer(m)]
  assert not bad, bad


def test_kernel_folders_exist(graph):
  # The per-op folders: other code imports ops.py (or the package).
  for op in ("gla", "kda"):
    for part in ("naive", "chunk", "intra", "passes", "backward", "tuning",
                 "step"):
      assert f"pallas_kernels.linear_attention.{op}.{part}" in graph
