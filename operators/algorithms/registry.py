"""A tiny name -> object registry, so configs can pick implementations by string."""

import ast
import functools
import importlib
import importlib.util
from pathlib import Path
from typing import Callable, Dict, Generic, List, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (usually functions) of one kind.

    `kind` is a human-readable label (e.g. "advantage estimator") used in
    error messages so a typo in a config says what was being looked up.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering the decorated object under `name`.

        Duplicates are refused: silently replacing an entry would make the
        behaviour depend on import order.
        """

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"duplicate {self.kind} name {name!r}: already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the entry for `name`; KeyError lists the valid names."""
        if name not in self._entries:
            available = ", ".join(self.names()) or "(none registered)"
            raise KeyError(
                f"unknown {self.kind} {name!r}; available: {available}. "
                f"Use one of the available names or register a new one with @register({name!r})."
            )
        return self._entries[name]

    def names(self) -> List[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def declared_names(module: str, attribute: str) -> tuple[str, ...]:
    """The names `module`'s own decorators register in its registry `attribute` (@ATTRIBUTE.register("name")),
    sorted, read from the module's source without importing it: config validation checks built-in names this
    way because operators.algorithms.losses imports torch, seconds of start-up for `streamrl validate`. The
    decorators are the only place a built-in name is written; tests/unit/test_config.py checks these equal
    the registry's names once the module is imported."""
    return _declared(module)[attribute] if attribute in _declared(module) else ()


@functools.lru_cache(maxsize=None)
def _declared(module: str) -> dict[str, tuple[str, ...]]:
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        for decorator in getattr(node, "decorator_list", ()):
            if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr == "register" and isinstance(decorator.func.value, ast.Name)
                    and decorator.args and isinstance(decorator.args[0], ast.Constant)):
                found.setdefault(decorator.func.value.id, []).append(decorator.args[0].value)
    return {name: tuple(sorted(names)) for name, names in found.items()}


def registry_of(module: str, attribute: str) -> "Registry":
    return getattr(importlib.import_module(module), attribute)


def is_registered(module: str, attribute: str, name: str) -> bool:
    """`name` is in the registry `module.attribute`; imports the module only for a name its decorators do not
    declare (one a user registers still validates)."""
    return name in declared_names(module, attribute) or name in registry_of(module, attribute)
