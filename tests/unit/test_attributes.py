"""The walls between a class and its parts, checked on the source of operators and pipelines (the
companion of test_architecture.py, whose module list it uses):

* no method reads `self.X` unless the class or one of its bases in the project assigns `self.X` in some
  method or defines X in its body (a class attribute, a dataclass field, a method, a property). A part
  that reads what its host happens to set (a mixin reading eleven of its host's attributes) fails here:
  give the part what it needs when it is made, or as an argument;
* no method overrides a base's method (within the project) with other parameters (names, order, *args,
  keyword-only, **kwargs; `__init__` and `__new__` excepted): a caller of the base's method must be able
  to call any subclass's.

A class with a base from outside the project (a pydantic model, an Exception, torch's Module, ...) is not
checked for the first rule: that base's attributes are not in view. `getattr(self, "X", ...)` counts as a
read of X and `setattr(self, "X", ...)` as an assignment."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field

from tests.unit.test_architecture import modules

CHECKED = ("operators", "pipelines")  # the packages whose classes are checked (bases resolve in any module)
HARMLESS_BASES = {"object", "ABC", "Generic", "Protocol"}  # bring no instance attributes
NOT_OVERRIDES = {"__init__", "__new__", "__init_subclass__"}  # constructors take what each class needs

# Reads of attributes the class never assigns, to be emptied: {class: {attributes}}, each with its reason.
UNASSIGNED_ALLOWED: dict[str, set[str]] = {
    # vLLM's `worker_extension_cls`: vLLM makes the class a base of its own Worker at run time, and these are
    # that Worker's attributes (vLLM's contract, not a host of ours). Declaring them in the class body
    # (`vllm_config: Any`, ...) would state the contract and empty this entry.
    "operators.engines.vllm_worker.WeightLoader": {"vllm_config", "model_runner", "weight_transfer_engine"},
}


@dataclass
class ClassInfo:
    key: str  # module.Class (module.Outer.Class for a nested class)
    module: str
    node: ast.ClassDef
    bases: list[str | None] = field(default_factory=list)  # project class keys; None: a base from outside
    defined: set[str] = field(default_factory=set)  # names bound in the class body
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    assigned: set[str] = field(default_factory=set)  # self.X assigned in a method
    reads: list[tuple[str, str, int]] = field(default_factory=list)  # (X, method, line) for each self.X read
    dynamic: bool = False  # setattr(self, <not a literal>, ...) or self.__dict__: attributes not in view


def _is_static(function) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)


def _receiver(function) -> str | None:
    """The name of a method's instance (or class) parameter; None for a static method."""
    if _is_static(function):
        return None
    positional = function.args.posonlyargs + function.args.args
    return positional[0].arg if positional else None


def _body_nodes(function):
    """Every node of a method's body, nested functions and lambdas included, nested classes not (their
    methods have a `self` of their own)."""
    stack = list(function.body) + list(function.args.defaults) + list(function.args.kw_defaults or [])
    while stack:
        node = stack.pop()
        if node is None:
            continue
        yield node
        if not isinstance(node, ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _scan_method(info: ClassInfo, name: str, function) -> None:
    receiver = _receiver(function)
    if receiver is None:
        return
    for node in _body_nodes(function):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
            if isinstance(node.ctx, ast.Store):
                info.assigned.add(node.attr)
            elif isinstance(node.ctx, ast.Load):
                if node.attr == "__dict__":
                    info.dynamic = True
                info.reads.append((node.attr, name, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == receiver):
            literal = (node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                       and isinstance(node.args[1].value, str) else None)
            if node.func.id == "setattr":
                if literal is None:
                    info.dynamic = True
                else:
                    info.assigned.add(literal)
            elif literal is not None:
                info.reads.append((literal, name, node.lineno))


def _class_body_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and item.value is not None:
                names |= {n.value for n in ast.walk(item.value)
                          if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return names


def _imported_names(module: str, tree: ast.Module, is_package: bool) -> dict[str, str]:
    """Local name -> dotted origin ("package.module.Name" or "package.module") for every import."""
    package = module if is_package else module.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def _dotted(expr) -> str | None:
    if isinstance(expr, ast.Subscript):  # Generic[T], a base with parameters
        return _dotted(expr.value)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else None
    return None


def parse_classes(sources: dict[str, str], packages: frozenset[str] = frozenset()) -> dict[str, ClassInfo]:
    """Every class of the given modules (module name -> source text; `packages`: the names that are
    packages, for relative imports), with its project bases resolved."""
    classes: dict[str, ClassInfo] = {}
    imported: dict[str, dict[str, str]] = {}
    local: dict[str, dict[str, str]] = {}  # module -> class name -> key (top-level classes first)
    pending: list[tuple[ClassInfo, list]] = []
    for module, text in sources.items():
        tree = ast.parse(text, module)
        imported[module] = _imported_names(module, tree, module in packages)
        local[module] = {}

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    key = f"{prefix}.{child.name}"
                    info = ClassInfo(key, module, child, defined=_class_body_names(child))
                    for item in child.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            info.methods[item.name] = item
                            _scan_method(info, item.name, item)
                    classes[key] = info
                    local[module].setdefault(child.name, key)
                    pending.append((info, child.bases))
                    visit(child, key)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{prefix}.{child.name}")
                else:
                    visit(child, prefix)

        visit(tree, module)

    def resolve(module: str, dotted: str, depth: int = 0) -> str | None:
        head, _, rest = dotted.partition(".")
        if not rest and head in local.get(module, {}):
            return local[module][head]
        origin = imported.get(module, {}).get(head)
        if origin is None or depth > 5:
            return None
        target = f"{origin}.{rest}" if rest else origin
        owner, _, name = target.rpartition(".")
        if owner in sources:
            return local[owner].get(name) if name in local[owner] else resolve(owner, name, depth + 1)
        return None

    for info, bases in pending:
        for base in bases:
            dotted = _dotted(base)
            if dotted is not None and dotted.rpartition(".")[2] in HARMLESS_BASES:
                continue
            info.bases.append(resolve(info.module, dotted) if dotted else None)
    return classes


def lineage(classes: dict[str, ClassInfo], key: str) -> list[ClassInfo | None]:
    """The class and its bases, nearest first (depth first, left to right); None for a base from outside."""
    out, seen, stack = [], set(), [key]
    while stack:
        current = stack.pop(0)
        if current is None or current not in classes:
            out.append(None)
            continue
        if current in seen:
            continue
        seen.add(current)
        out.append(classes[current])
        stack = list(classes[current].bases) + stack
    return out


def unassigned_reads(classes: dict[str, ClassInfo], checked=lambda key: True) -> list[tuple[str, str, str, int]]:
    """(class, attribute, method, line) for each read of an attribute that neither the class nor a project
    base assigns or defines. Classes with a base from outside the project, or that set attributes by
    computed names, are left out."""
    found = []
    for key, info in classes.items():
        if not checked(key):
            continue
        chain = lineage(classes, key)
        if any(c is None or c.dynamic for c in chain):
            continue
        known = set().union(*(c.defined | c.assigned for c in chain))
        for attribute, method, line in info.reads:
            if attribute not in known and not (attribute.startswith("__") and attribute.endswith("__")):
                found.append((key, attribute, method, line))
    return found


def _parameters(function) -> tuple:
    args = function.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    if not _is_static(function):
        positional = positional[1:]
    return tuple(positional), args.vararg is not None, tuple(a.arg for a in args.kwonlyargs), args.kwarg is not None


def _describe(parameters: tuple) -> str:
    positional, vararg, keyword_only, kwarg = parameters
    return "(" + ", ".join([*positional, *(["*args"] if vararg else ["*"] if keyword_only else []), *keyword_only,
                            *(["**kwargs"] if kwarg else [])]) + ")"


def changed_overrides(classes: dict[str, ClassInfo], checked=lambda key: True) -> list[str]:
    """One line per method that overrides the nearest project base's method of that name with other parameters."""
    found = []
    for key, info in classes.items():
        if not checked(key):
            continue
        bases = [c for c in lineage(classes, key)[1:] if c is not None]
        for name, function in info.methods.items():
            if name in NOT_OVERRIDES:
                continue
            base = next((c for c in bases if name in c.methods or name in c.defined), None)
            if base is None or name not in base.methods:
                continue
            mine, theirs = _parameters(function), _parameters(base.methods[name])
            if mine != theirs:
                found.append(f"{key}.{name}{_describe(mine)} overrides {base.key}.{name}{_describe(theirs)}")
    return found


@functools.cache
def project_classes() -> dict[str, ClassInfo]:
    known = modules()
    return parse_classes({name: file.read_text() for name, file in known.items()},
                         frozenset(name for name, file in known.items() if file.name == "__init__.py"))


def _in_checked(key: str) -> bool:
    return key.split(".")[0] in CHECKED


# --- the rules on the project ----------------------------------------------------------------------------

def test_no_class_reads_an_attribute_it_never_assigns():
    found = [(key, attribute, method, line) for key, attribute, method, line in
             unassigned_reads(project_classes(), _in_checked)
             if attribute not in UNASSIGNED_ALLOWED.get(key, set())]
    assert not found, "\n".join(f"{key}.{method} (line {line}) reads self.{attribute}, which neither it nor a base "
                                f"assigns or defines" for key, attribute, method, line in found)


def test_the_allow_list_names_only_reads_that_still_happen():
    found = {(key, attribute) for key, attribute, _, _ in unassigned_reads(project_classes(), _in_checked)}
    stale = {(key, attribute) for key, attributes in UNASSIGNED_ALLOWED.items() for attribute in attributes} - found
    assert not stale, f"no longer read unassigned, remove from UNASSIGNED_ALLOWED: {sorted(stale)}"


def test_no_method_overrides_another_with_other_parameters():
    found = changed_overrides(project_classes(), _in_checked)
    assert not found, "\n".join(found)


# --- the checker on examples ----------------------------------------------------------------------------

HOST_AND_MIXIN = '''
class Publishing:
    def publish(self):
        return self.store.put(self.version)


class Worker(Publishing):
    LIMIT = 3

    def __init__(self, store):
        self.store, self.version = store, 0

    def step(self, samples, tokens):
        self.version += 1
        return self.LIMIT + len(samples) + self.later

    @property
    def ready(self):
        return getattr(self, "cache", None) is not None


class Critic(Worker):
    def step(self, samples):
        return self.value_head
'''

COMPOSED = '''
from pkg.parts import Publisher


class Worker:
    def __init__(self, store):
        self.publisher = Publisher(store)
        self.version = 0

    def step(self, samples, tokens, *, scale=1.0):
        self.version += 1
        return self.publisher.publish(self.version)


class Critic(Worker):
    def step(self, samples, tokens, *, scale=1.0):
        self.head = 1
        return self.head + self.version
'''

PARTS = '''
class Publisher:
    def __init__(self, store):
        self.store = store
        self.last = None

    def publish(self, version):
        self.last = version
        return self.store.put(version)
'''


def test_the_checker_finds_a_mixin_reading_its_host_and_a_changed_override():
    classes = parse_classes({"pkg.mixin": HOST_AND_MIXIN})
    assert classes["pkg.mixin.Critic"].bases == ["pkg.mixin.Worker"]
    assert sorted((key, attribute) for key, attribute, _, _ in unassigned_reads(classes)) == [
        ("pkg.mixin.Critic", "value_head"),  # nowhere assigned
        ("pkg.mixin.Publishing", "store"),  # the mixin reads what only its host sets
        ("pkg.mixin.Publishing", "version"),
        ("pkg.mixin.Worker", "cache"),  # getattr(self, "cache", None): made nowhere
        ("pkg.mixin.Worker", "later"),
    ]
    assert changed_overrides(classes) == [
        "pkg.mixin.Critic.step(samples) overrides pkg.mixin.Worker.step(samples, tokens)"]


def test_the_checker_passes_composed_parts_and_resolves_imported_bases():
    classes = parse_classes({"pkg.worker": COMPOSED, "pkg.parts": PARTS})
    assert unassigned_reads(classes) == [] and changed_overrides(classes) == []
    extended = parse_classes({"pkg.parts": PARTS, "pkg.more": "from pkg.parts import Publisher as P\n"
                              "class Loud(P):\n    def publish(self, version, loud):\n        return self.store\n"})
    assert extended["pkg.more.Loud"].bases == ["pkg.parts.Publisher"]
    assert unassigned_reads(extended) == []
    assert changed_overrides(extended) == [
        "pkg.more.Loud.publish(version, loud) overrides pkg.parts.Publisher.publish(version)"]


def test_a_base_from_outside_the_project_leaves_the_attributes_unchecked():
    classes = parse_classes({"pkg.model": "import torch\nclass Net(torch.nn.Module):\n"
                                          "    def forward(self, x):\n        return self.training\n"})
    assert classes["pkg.model.Net"].bases == [None]
    assert unassigned_reads(classes) == []
