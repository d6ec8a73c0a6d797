"""The type stubs ship with the installed package (`_vmm_arena.pyi` and
`py.typed`, PEP 561) and match the extension module: every name it exports
is declared, every class's methods and properties are, nothing declared is
missing from the module, and each callable's parameters (names, kinds,
which have defaults) are the ones the module takes."""
import ast
import inspect
from pathlib import Path

import pytest

import vmm_arena
from vmm_arena import _vmm_arena as ext

PACKAGE = Path(vmm_arena.__file__).parent
# Special methods a class defines that callers use (the rest, e.g. __repr__,
# need no declaration).
USED_DUNDERS = {"__dlpack__", "__dlpack_device__", "__enter__", "__exit__", "__len__"}
MODULE_DUNDERS = {"__doc__", "__file__", "__loader__", "__name__", "__package__", "__spec__", "__all__"}


def stub_tree():
    path = PACKAGE / "_vmm_arena.pyi"
    assert path.is_file(), f"{path} is not installed with the package"
    return ast.parse(path.read_text(), filename=str(path))


def declared(body):
    """{name: node} of the functions, classes and annotated names in `body`."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def is_property(node):
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def stub_params(fn, method):
    """[(name, kind, has_default)] of a stub function, self/cls dropped."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(positional, defaults):
        kind = "positional_only" if arg in a.posonlyargs else "positional_or_keyword"
        out.append((arg.arg, kind, d is not None))
    if a.vararg is not None:
        out.append(("*", "var_positional", False))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "keyword_only", d is not None))
    if a.kwarg is not None:
        out.append(("**", "var_keyword", False))
    if method and out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def runtime_params(obj):
    """The same for the module's callable (None where it has no signature)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            out.append(("*", "var_positional", False))
        elif p.kind == p.VAR_KEYWORD:
            out.append(("**", "var_keyword", False))
        else:
            out.append((p.name, p.kind.name.lower(), p.default is not p.empty))
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    # A stub's self is written plainly; PyO3 marks it positional-only.
    return out


def comparable(params):
    """Positional-only and positional-or-keyword read alike: stubs for
    Python 3.9 write both as plain parameters."""
    return [(n, "positional" if k.startswith("positional") else k, d) for n, k, d in params]


def test_py_typed_is_installed():
    assert (PACKAGE / "py.typed").is_file(), "py.typed (PEP 561) missing from the installed package"


def test_every_export_is_declared_and_every_declaration_exists():
    stubs = declared(stub_tree().body)
    exported = {n for n in dir(ext) if n not in MODULE_DUNDERS and not n.startswith("__")}
    missing = sorted(exported - set(stubs))
    assert not missing, f"exported by the extension, not in _vmm_arena.pyi: {missing}"
    private = {n for n in stubs if n.startswith("_") and not hasattr(ext, n)}
    stale = sorted({n for n in stubs if not n.startswith("_") and not hasattr(ext, n)} | private)
    # Type aliases of the stub itself (_AllocationLike, ...) are not exports.
    stale = [n for n in stale if not isinstance(stubs[n], ast.Assign)]
    assert not stale, f"declared in _vmm_arena.pyi, not in the extension: {stale}"


@pytest.mark.parametrize("name", sorted(n for n in dir(ext) if isinstance(getattr(ext, n), type)))
def test_each_class_is_declared_member_by_member(name):
    cls = getattr(ext, name)
    node = declared(stub_tree().body)[name]
    members = declared(node.body)
    base_members = {}
    for b in node.bases:
        if isinstance(b, ast.Name):
            base_members.update(declared(declared(stub_tree().body)[b.id].body))
    own = {n for n in vars(cls) if not n.startswith("_") or n in USED_DUNDERS}
    missing = sorted(n for n in own if n not in members and n not in base_members)
    assert not missing, f"{name}: not declared in _vmm_arena.pyi: {missing}"
    for m, fn in members.items():
        if m in ("__new__", "__init__", "__eq__", "__hash__"):
            continue
        assert hasattr(cls, m), f"{name}.{m} is declared but does not exist"
        runtime = inspect.getattr_static(cls, m)
        is_getset = inspect.isgetsetdescriptor(runtime) or isinstance(runtime, property)
        assert is_property(fn) == is_getset, f"{name}.{m}: property in one, method in the other"
        if not is_getset:
            want = runtime_params(getattr(cls, m))
            if want is not None:
                assert comparable(stub_params(fn, True)) == comparable(want), f"{name}.{m}'s parameters"
    if "__new__" in members:
        want = runtime_params(cls)
        assert want is not None, f"{name} declares a constructor the extension lacks"
        assert comparable(stub_params(members["__new__"], True)) == comparable(want), f"{name}()'s parameters"
    else:
        assert runtime_params(cls) is None, f"{name} is constructible: declare __new__"


def test_module_functions_take_the_declared_parameters():
    stubs = declared(stub_tree().body)
    for n, node in stubs.items():
        if isinstance(node, ast.FunctionDef):
            want = runtime_params(getattr(ext, n))
            assert want is not None, n
            assert comparable(stub_params(node, False)) == comparable(want), f"{n}'s parameters"
