"""A tiny name -> object registry, so configs can pick implementations by string."""

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


# The names each built-in registry holds once its module is imported, for checks that must not import
# that module (config validation: operators.algorithms.losses imports torch, which alone takes seconds).
# tests/unit/test_config.py checks they match the registries. A name not listed here is looked up in the
# registry itself, so implementations a user registers still validate.
BUILTIN_NAMES = {
    ("operators.algorithms.losses", "POLICY_LOSSES"): ("decoupled_ppo", "gspo", "ppo_clip"),
    ("operators.algorithms.losses", "LOSS_AGGREGATIONS"): ("seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"),
    ("operators.algorithms.losses", "KL_ESTIMATORS"): ("k1", "k2", "k3"),
    ("operators.algorithms.estimators", "ADVANTAGE_ESTIMATORS"): ("dr_grpo", "grpo", "grpo_no_std", "reinforce_pp_baseline", "rloo"),
    ("operators.algorithms.estimators", "TOKEN_ESTIMATORS"): ("gae",),
}


def registry_of(module: str, attribute: str) -> "Registry":
    import importlib

    return getattr(importlib.import_module(module), attribute)


def is_registered(module: str, attribute: str, name: str) -> bool:
    """`name` is in the registry `module.attribute`; imports the module only for a name that is not built in."""
    return name in BUILTIN_NAMES.get((module, attribute), ()) or name in registry_of(module, attribute)
