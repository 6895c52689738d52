"""Eviction policies of the expert slot table (``ftjax.experts.slot_table``): a registry, one module each.

Every module of this package but ``base`` holds one policy: one :class:`CachePolicy` subclass, registered
under the module's name (``lru.py`` -> ``"lru"``). The modules are found when this package is imported
(``pkgutil``), so adding a policy is adding one file: the slot table, ``EngineConfig.cache_policy``, the
CLI's ``--cache_policy``, the offline studies (``experiments/policy_study.py``, ``replay_policies.py``,
``ab_slot_table.py``) and the tests parametrized over :func:`names` pick it up. (Layout after LMCache's
``lmcache/v1/storage_backend/cache_policy/``.)

  from ftjax.experts import policies
  policies.names()                         # ('lfru', 'lfu', 'lookahead', 'lru')
  policies.get("lfru", half_life_tokens=8) # LFRU(half_life_tokens=8), hashable: a static jit argument
  slot_table.lookup_layer(table, layer, routed, E, policy=policies.get("lfru", half_life_tokens=8))
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType

from ftjax.experts.policies.base import CachePolicy

__all__ = ["CachePolicy", "REGISTRY", "names", "policy_class", "get", "resolve", "describe"]


def _discover() -> dict[str, type[CachePolicy]]:
    """{module name: the one CachePolicy subclass it defines}, sorted by name.

    Raises:
      ImportError: a policy module defines no CachePolicy subclass or more than one.
    """
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        classes = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, CachePolicy) and c.__module__ == module.__name__]
        if len(classes) != 1:
            raise ImportError(f"cache policy module {module.__name__} must define exactly one CachePolicy "
                              f"subclass, found {[c.__name__ for c in classes]}")
        if not classes[0].description or "\n" in classes[0].description:
            raise ImportError(f"cache policy {info.name!r}: {classes[0].__name__}.description must be one line")
        found[info.name] = classes[0]
    return dict(sorted(found.items()))


REGISTRY = MappingProxyType(_discover())
"""Read-only {name: CachePolicy subclass} of every registered policy, sorted by name."""


def names() -> tuple[str, ...]:
    """The registered policy names, sorted."""
    return tuple(REGISTRY)


def policy_class(name: str) -> type[CachePolicy]:
    """The class registered as ``name``. Raises ValueError naming ``name`` and the known policies."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cache policy {name!r}; expected one of {names()}") from None


def get(name: str, **params) -> CachePolicy:
    """An instance of policy ``name`` with ``params`` (its dataclass fields; the rest default).

    Raises:
      ValueError: unknown ``name`` (the message lists the known ones), a parameter the policy does not
        take, or a value it rejects.
    """
    cls = policy_class(name)
    unknown = sorted(set(params) - set(cls.param_names()))
    if unknown:
        raise ValueError(f"cache policy {name!r} takes parameters {cls.param_names()}, got {unknown}")
    return cls(**params)


def resolve(policy: str | CachePolicy, **offered) -> CachePolicy:
    """``policy`` itself if it is an instance, else ``get(policy, ...)`` with those of ``offered`` that the
    policy takes (the rest are ignored: e.g. ``half_life_tokens`` is offered to every policy by the slot
    table, and taken only by ``lfru``). Raises ValueError for an unknown name."""
    if isinstance(policy, CachePolicy):
        return policy
    cls = policy_class(policy)
    return get(policy, **{k: v for k, v in offered.items() if k in cls.param_names()})


def describe(sep: str = "; ") -> str:
    """``"name: description"`` of every registered policy, joined by ``sep`` (for ``--help`` texts)."""
    return sep.join(f"{n}: {c.description}" for n, c in REGISTRY.items())
