"""The code's shape, as issue #52 fixed it: every jit function (Triton and Gluon) takes at most
64 parameters, and no package module imports another that imports it back (a cycle)."""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import omniattn

MAX_PARAMETERS = 64
PACKAGE = pathlib.Path(omniattn.__file__).parent


def _modules():
    for info in pkgutil.walk_packages(omniattn.__path__, "omniattn."):
        if info.name == "omniattn.integrations.transformers":
            continue  # registers with transformers when imported; it has no jit function
        yield importlib.import_module(info.name)


def test_no_jit_function_takes_more_than_64_parameters():
    jit_functions = {}
    for module in _modules():
        for name, value in vars(module).items():
            # under TRITON_INTERPRET=1 triton.jit gives InterpretedFunctions (Gluon's stay jit)
            if isinstance(value, (JITFunction, InterpretedFunction)) \
                    and value.fn.__module__ == module.__name__:
                count = len(inspect.signature(value.fn).parameters)
                jit_functions[f"{module.__name__}.{name}"] = count
    assert len(jit_functions) > 50  # the walk found the kernels
    assert {"omniattn.backends.triton.forward._fwd_kernel",
            "omniattn.backends.gluon_sm90.backward._bwd_hopper_kernel"} <= set(jit_functions)
    too_long = {name: count for name, count in jit_functions.items() if count > MAX_PARAMETERS}
    assert not too_long, too_long


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules a module imports (relative and absolute, function-level included)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        module = package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found.update(n for n in names if (PACKAGE.parent / n.replace(".", "/")).with_suffix(
                ".py").exists() or (PACKAGE.parent / n.replace(".", "/")).is_dir())
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("omniattn") and name != module}


def test_no_import_cycles():
    imports = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        imports[module.removesuffix(".__init__")] = _imports(path)
    graph = {module: {name for name in names if name in imports}
             for module, names in imports.items()}
    # depth-first; a package importing its own modules (re-exports) is no cycle
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for name in sorted(graph[module]):
            if name.startswith(module + "."):
                continue
            if state.get(name) == "open":
                raise AssertionError(" -> ".join(stack[stack.index(name):] + [name]))
            if name not in state:
                visit(name)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


_WINDOW_NAMES = {"diag", "diag_left", "diag_offset", "window_left", "window_right", "rel"}


def _broadcast(node: ast.AST) -> bool:
    """x[None, :] / x[:, None]: an operand spread over a tile."""
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and any(
        isinstance(e, ast.Constant) and e.value is None for e in node.slice.elts)


def _element_window_comparisons(path: pathlib.Path) -> dict[str, int]:
    """Per function of the file: comparisons over a tile's elements ([BM, BN] broadcasts or the
    relative offset `rel`) that read a diagonal or window bound: the window predicate."""
    found: dict[str, int] = {}
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.Compare):
                continue
            parts = [node.left, *node.comparators]
            names = {n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)}
            tile = any(_broadcast(n) for part in parts for n in ast.walk(part)) or "rel" in names
            if tile and names & _WINDOW_NAMES:
                found[function.name] = found.get(function.name, 0) + 1
    return found


def test_one_window_predicate_per_kernel_dialect():
    """The causal / window element predicate is written once per kernel dialect:
    `kernels.common.visible_elements` for the Triton kernels, `blocks.drop_outside_window` for
    the Gluon ones; every other kernel calls those (issue #52)."""
    homes = {"gluon": {("backends/gluon_sm90/blocks.py", "drop_outside_window")},
             "triton": {("kernels/common.py", "visible_elements")}}
    for dialect, folders in (("gluon", ["backends/gluon_sm90"]),
                             ("triton", ["backends/triton", "kernels"])):
        written = {(str(path.relative_to(PACKAGE)), function)
                   for folder in folders for path in sorted((PACKAGE / folder).glob("*.py"))
                   for function in _element_window_comparisons(path)}
        assert written == homes[dialect], f"{dialect}: the window predicate is written in {written}"
