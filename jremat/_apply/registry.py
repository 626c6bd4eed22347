"""The implementation of :mod:`jremat.registry` (its public names are re-exported there)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jremat._spec.text import NAME_RE, REQUIRED, Param, canonical_spec, convert_values, parse_spec, value_as_text

if TYPE_CHECKING:  # imported where used, so that parsing a spec imports no JAX (the CLIs check flags first)
    from jremat._apply.policy import Policy

ENTRY_POINT_GROUP = "jremat.policies"
BUILTIN_MODULE = "jremat.policies"


#: The key every policy of one function takes: also keep the gathered weights (jremat._apply.gathered).
KEEP_GATHERED = "keep_gathered"
KEEP_GATHERED_PARAM = Param(
    "bool",
    False,
    "also keep each checkpoint's gathered weights (a sharding constraint on an input feeding a matmul), so "
    "that the backward pass does not all-gather them again; costs their gathered bytes per device",
)

#: The key every policy of one function takes: also keep the outputs of collectives (jremat._apply.collectives).
KEEP_COLLECTIVES = "keep_collectives"
KEEP_COLLECTIVES_PARAM = Param(
    "bool",
    False,
    "also keep the output of every collective each checkpoint's recomputation would issue again (all-gathers, "
    "all-to-alls, all-reduces, reduce-scatters written in a shard_map, the gathered weights of keep_gathered, and "
    "the weights XLA gathers on a mesh of one split axis); costs their output bytes per device",
)
#: The keys every policy of one function takes, by name.
UNIVERSAL_PARAMS = {KEEP_GATHERED: KEEP_GATHERED_PARAM, KEEP_COLLECTIVES: KEEP_COLLECTIVES_PARAM}


class AlreadyRegisteredError(ValueError):
    """A policy name given to :func:`register` is taken."""


@dataclasses.dataclass(frozen=True)
class PolicyEntry:
    """A registered policy: its name, documentation, accepted keys and factory.

    Attributes:
      stack: ``True`` for an option of a whole layer stack (``nested``): the factory returns a
        dict of :class:`jremat.RematConfig` fields instead of a :class:`Policy`.
    """

    name: str
    doc: str
    params: dict[str, Param]
    factory: Callable[..., Any]
    stack: bool = False


_REGISTRY: dict[str, PolicyEntry] = {}
# Guards every read and write of _REGISTRY and _FAILED_LOADS; held only for the dict operation
# itself, never across an import: a module being imported may register or look a policy up from
# any thread without waiting on a thread that is itself waiting for that import.
_REGISTRY_LOCK = threading.Lock()
_builtins_loaded = False
# Per thread: whether a loading pass runs (a lookup from a module it imports returns at once).
_LOADING = threading.local()
# The error of an entry point's last failed load, by entry point.
_FAILED_LOADS: dict = {}


def register(name: str, *, doc: str, params: dict[str, Param] | None = None, stack: bool = False):
    """Decorator registering a policy factory under ``name``.

    The factory receives the parsed keys as keyword arguments and returns a :class:`Policy`
    (with ``stack=True``: a dict of :class:`jremat.RematConfig` fields).

    Args:
      name: the policy name used in specs (letters, digits, underscores).
      doc: what the policy saves, in one or two sentences.
      params: the keys the spec accepts.
      stack: the entry sets how a layer stack is checkpointed rather than building a policy
        of one function (see :func:`stack_fields`).

    Raises:
      ValueError: if the name is malformed or already registered.
    """
    if not NAME_RE.match(name):
        raise ValueError(f"policy name {name!r} must be letters, digits and underscores")

    def decorator(factory):
        entry = PolicyEntry(name=name, doc=doc, params=dict(params or {}), factory=factory, stack=stack)
        with _REGISTRY_LOCK:
            if name in _REGISTRY:
                raise AlreadyRegisteredError(f"policy {name!r} is already registered")
            _REGISTRY[name] = entry
        return factory

    return decorator


def unregister(name: str) -> None:
    """Remove a registered policy (for interactive use; tests use :func:`scoped`)."""
    with _REGISTRY_LOCK:
        _REGISTRY.pop(name, None)


@contextlib.contextmanager
def scoped():
    """Context manager: policies registered or removed inside it are undone on exit.

    The registry holds exactly the entries it held on entry again when the block exits
    (normally or by an exception); built-ins are loaded first, so they stay. For tests, benches
    and notebooks that add policies without leaving them behind for whatever runs next::

        with jremat.registry.scoped():
            jremat.register("baseline", doc="...")(Baseline)
            run_bench(["none", "baseline"])
    """
    saved = entries()
    try:
        yield
    finally:
        with _REGISTRY_LOCK:
            _REGISTRY.clear()
            _REGISTRY.update(saved)


def _load_builtins() -> None:
    """Import the built-in policies and the entry points' modules before a thread's first lookup.

    No lock of this module is held across an import. Each thread that looks up before loading has
    finished imports them itself; Python's import locks run each module once, and make a thread
    wait for a module another thread is importing, so a first lookup sees every policy. A lookup
    made while a module is being imported by the same thread (a plugin that looks a policy up at
    import) proceeds with the entries registered so far. The loaded flag is set once a pass has
    found every module imported in full, so an import that fails is tried again (and raises
    again) on the next lookup.
    """
    global _builtins_loaded
    if _builtins_loaded or getattr(_LOADING, "active", False):
        return
    _LOADING.active = True
    try:
        importlib.import_module(BUILTIN_MODULE)
        complete = not _initializing(BUILTIN_MODULE)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _load_entry_point(ep)
            complete = complete and not _initializing(getattr(ep, "module", None))
        if complete:  # not while this thread is still importing one of them
            _builtins_loaded = True
    finally:
        _LOADING.active = False


def _initializing(module_name: str | None) -> bool:
    """Whether the module is being imported (its body has not finished), by any thread."""
    module = sys.modules.get(module_name) if module_name else None
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def _load_entry_point(ep) -> None:
    """``ep.load()``; after a failed load, a retry that fails only on the names the failed one
    registered raises the plugin's own error again."""
    try:
        ep.load()
    except AlreadyRegisteredError:
        with _REGISTRY_LOCK:
            failed = _FAILED_LOADS.get(ep)
        if failed is None:
            raise
        raise failed from None
    except Exception as err:
        with _REGISTRY_LOCK:
            _FAILED_LOADS[ep] = err
        raise
    with _REGISTRY_LOCK:
        _FAILED_LOADS.pop(ep, None)


def load_module(module_name: str) -> None:
    """Import ``module_name`` so that the policies it registers become available by name.

    Raises:
      ValueError: if the module cannot be imported.
    """
    try:
        importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import policy module {module_name!r}: {err}") from err


def entries() -> dict[str, PolicyEntry]:
    """All registered policies by name, built-ins included."""
    _load_builtins()
    with _REGISTRY_LOCK:
        return dict(_REGISTRY)


def available() -> list[str]:
    """Sorted names of all registered policies."""
    return sorted(entries())


def describe(name: str | None = None) -> str:
    """Help text: every policy (no argument), or one policy in full.

    Args:
      name: a registered policy's name (``"every_k"``); ``None`` lists every policy, its keys
        and what it saves, one entry each.

    Returns:
      For one policy: what it saves, each key with its type, default and meaning, and an example
      spec (every key at its default; a required key as ``<kind>``, to fill in).

    Raises:
      TypeError: if ``name`` is not a string.
      ValueError: if ``name`` is a spec with keys, or names no registered policy; the message
        lists the valid names.
    """
    registered = entries()
    if name is None:
        lines = []
        for entry_name, entry in sorted(registered.items()):
            keys = ", ".join(
                f"{k}=<{p.kind}>" + ("" if p.default is REQUIRED else f" (default {p.default})")
                for k, p in entry.params.items()
            )
            lines.append(f"  {entry_name}{':' + keys if keys else ''}\n      {entry.doc}")
        return "\n".join(lines)
    if not isinstance(name, str):
        raise TypeError(f"describe takes a policy name (a string such as 'every_k'), got {type(name).__name__}")
    stripped = name.strip()
    bare = stripped.partition(":")[0]
    if bare != stripped and bare in registered:
        raise ValueError(f"describe takes a policy name, not a spec: describe({bare!r}) for {name!r}")
    if stripped not in registered:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(registered))}")
    return _describe_one(registered[stripped])


def _describe_one(entry: PolicyEntry) -> str:
    """The full help of one policy (see :func:`describe`)."""
    lines = [f"{entry.name}: {entry.doc}"]
    if entry.stack:
        lines.append(
            "  a layer stack's option: give it to jremat.RematConfig / run_layers or the train CLIs' --policy, "
            "not to a single function"
        )
    example = []
    lines.append("  keys:" if entry.params else "  keys: none (the spec is the name alone)")
    for key, param in entry.params.items():
        bound = f", >= {param.min:g}" if param.min is not None else ""
        if param.default is REQUIRED:
            lines.append(f"    {key}=<{param.kind}>  required{bound}: {param.help}")
            example.append(f"{key}=<{param.kind}>")
            continue
        try:
            default = value_as_text(entry.name, key, param, param.default)
        except ValueError:  # a default no spec could give
            default = repr(param.default)
        lines.append(f"    {key}=<{param.kind}>  default {default or '(none)'}{bound}: {param.help}")
        if default:
            example.append(f"{key}={default}")
    spec = entry.name + (":" + ",".join(example) if example else "")
    lines.append(f"  example: {spec}" + ("  (fill in each <...>)" if "<" in spec else ""))
    return "\n".join(lines)


def resolve(spec: str | Policy, **overrides: Any) -> Policy:
    """Build the policy a spec names.

    Args:
      spec: a spec string (``"every_k:k=4"``) or a :class:`Policy` (returned as is).
      **overrides: keys given separately (e.g. from ``--k 4``); they override the string's.
        Values may be strings (parsed like the spec) or already-typed values.

    Returns:
      The :class:`Policy`, with :attr:`Policy.spec` set to the canonical spec.

    Raises:
      ValueError: unknown policy, unknown key, malformed string, or a bad value; the message
        names the bad part and lists the valid choices. Also for a layer-stack entry
        (``nested``), which is no policy of a single function.
    """
    resolved = resolve_spec(spec, **overrides)
    if resolved.policy is None:
        raise ValueError(stack_error(resolved.name))
    return resolved.policy


@dataclasses.dataclass(frozen=True)
class ResolvedSpec:
    """A spec resolved once: its canonical text and what it builds.

    Attributes:
      spec: the canonical spec string (``"every_k:k=4"``; ``""`` for a hand-made policy).
      policy: the :class:`Policy` of a per-function spec (or the policy given), ``None`` for a
        layer-stack spec.
      stack_fields: the :class:`jremat.RematConfig` fields a layer-stack spec (``nested:block=2``)
        stands for, ``None`` otherwise.
    """

    spec: str
    policy: Policy | None
    stack_fields: dict[str, Any] | None

    @property
    def name(self) -> str:
        """The policy's registered name (``"every_k"``; ``""`` for a hand-made policy)."""
        return self.spec.partition(":")[0]


def resolve_spec(spec: str | Policy, **overrides: Any) -> ResolvedSpec:
    """Parse and resolve ``spec`` once, for any entry: a per-function policy or a layer-stack one.

    Args:
      spec: a spec string or a :class:`Policy` (returned as it is).
      **overrides: key values that replace those in the spec (``None`` values are ignored).

    Raises:
      ValueError: as :func:`resolve`, for a malformed or unknown spec string or bad overrides.
    """
    from jremat._apply.policy import Policy

    if isinstance(spec, Policy):
        if overrides:
            raise ValueError(f"cannot apply keys {sorted(overrides)} to an already-built policy {spec!r}")
        return ResolvedSpec(spec.spec, spec, None)
    entry, built, canonical = _build(spec, overrides)
    if entry.stack:
        return ResolvedSpec(canonical, None, dict(built))
    built.spec = canonical
    return ResolvedSpec(canonical, built, None)


def stack_error(name: str) -> str:
    """The message for a layer-stack entry (``nested``) used as the policy of one function."""
    return (
        f"policy {name!r} checkpoints a stack of layers; use it as a layer stack's policy "
        "(jremat.RematConfig / run_layers, or --policy of the train CLIs), not on a single function"
    )


def stack_fields(spec: Any) -> dict[str, Any] | None:
    """The :class:`jremat.RematConfig` fields a layer-stack spec (``nested:block=2``) stands for.

    Args:
      spec: anything given as a policy: a spec string or a :class:`Policy`.

    Returns:
      The fields (e.g. ``{"policy": "none", "nest": 2}``) for a spec naming a layer-stack
      entry; ``None`` for a :class:`Policy` or a spec of a per-function policy.

    Raises:
      ValueError: as :func:`resolve`, for a malformed or unknown spec string.
    """
    if not isinstance(spec, str):
        return None
    return resolve_spec(spec).stack_fields


def normalize_spec(spec: str | Policy, **overrides: Any) -> str:
    """The canonical spec string of ``spec`` with ``overrides`` applied, for any entry.

    The same string as ``resolve(spec, **overrides).spec`` for a per-function policy; layer-stack
    entries (``nested``) are checked and written back the same way.

    Raises:
      ValueError: as :func:`resolve` (except for layer-stack entries, which are accepted).
    """
    return resolve_spec(spec, **overrides).spec


def _build(spec: str, overrides: dict[str, Any]) -> tuple[PolicyEntry, Any, str]:
    """``(entry, factory result, canonical spec)`` for a spec string."""
    name, raw_values = parse_spec(spec)
    registry = entries()
    if name not in registry:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(registry))}")
    entry = registry[name]
    raw_values.update({k: v for k, v in overrides.items() if v is not None})
    # keep_gathered (jremat._apply.gathered) and keep_collectives (jremat._apply.collectives) are
    # keys of every policy of one function.
    universal = {} if entry.stack else {k: p for k, p in UNIVERSAL_PARAMS.items() if k not in entry.params}
    kwargs = convert_values(name, {**entry.params, **universal}, raw_values)
    keep = {key: kwargs.pop(key) for key in universal}
    built = entry.factory(**kwargs)
    given = {k: v for k, v in kwargs.items() if k in raw_values}
    if keep.get(KEEP_COLLECTIVES) and KEEP_GATHERED in raw_values and not keep.get(KEEP_GATHERED):
        raise ValueError(
            f"{name}: keep_collectives=true keeps the gathered weights too; drop keep_gathered=false from the spec"
        )
    if KEEP_COLLECTIVES in raw_values and KEEP_COLLECTIVES in universal:
        from jremat._apply.collectives import with_keep_collectives

        built = with_keep_collectives(built, keep[KEEP_COLLECTIVES])
        given[KEEP_COLLECTIVES] = keep[KEEP_COLLECTIVES]
    if KEEP_GATHERED in raw_values and KEEP_GATHERED in universal:
        from jremat._apply.gathered import with_keep_gathered

        if not keep.get(KEEP_COLLECTIVES):  # keep_collectives keeps them already
            built = with_keep_gathered(built, keep[KEEP_GATHERED])
        given[KEEP_GATHERED] = keep[KEEP_GATHERED]
    return entry, built, canonical_spec(name, given, entry.params)
