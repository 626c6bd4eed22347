"""Rematerialization of a model's layer stacks: where its checkpoints go and with which policy.

Models describe *where* a checkpoint may go (a whole block, or each sublayer) by passing their
functions through :func:`remat_at`; the :class:`RematConfig` decides which level is active and
with which policy. :func:`run_layers` runs a stack of identical layers under ``lax.scan`` (or
unrolled) with the policy applied per layer.

Nesting (√n checkpointing of groups of layers) is a property of the stack, not of a policy:
:attr:`RematConfig.nest`. The spec ``nested:block=M,layer=SPEC`` is its spelling wherever a
policy spec is given for a stack (the train CLIs' ``--policy``, ``ModelConfig.remat_policy``);
:class:`RematConfig` turns it into ``policy=SPEC, nest=M`` on construction, the one place it is
read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jremat._apply import registry
from jremat._apply.keys import parse_nest
from jremat._apply.policy import CallbackPolicy, Policy
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import tie as _tie
from jremat._spec import names
from jremat._spec.granularity import GRANULARITIES

# The stack's slices, splits and scans are bound for the model: attributed to its call of run_layers.
_jax_compat.exclude_from_tracebacks(__file__)


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """Where and how a layer stack is rematerialized.

    Attributes:
      policy: a policy spec (``"full"``, ``"every_k:k=4"``) or a :class:`Policy`.
      granularity: ``"none"`` (no checkpoint), ``"block"`` (one per layer) or ``"sublayer"``
        (attention and MLP each in their own checkpoint).
      scan_layers: run layers under ``lax.scan`` over stacked parameters (default) instead of
        an unrolled Python loop.
      layer_policies: different policies for contiguous groups of layers, in layer order:
        ``"COUNT:SPEC,COUNT:SPEC,...[,rest:SPEC]"`` (see :func:`parse_layer_policies`), e.g.
        ``"2:full,rest:none"`` (Megatron's recompute-num-layers). Layers not covered by a group
        use :attr:`policy`. Empty (default): every layer uses :attr:`policy`.
      nest: nested (√n) checkpointing of the stack (Chen et al. 2016; Haliax's ``nested``):
        ``None`` (default) for none, else the group size ``m`` — a positive integer dividing
        the number of layers, or ``"auto"`` for the divisor closest to its square root. The
        ``L`` layers are cut into ``L / m`` groups of ``m`` consecutive layers; the outer loop
        runs the groups, each group is one checkpoint that saves only its input, and inside it
        the layers run with :attr:`policy` at :attr:`granularity` (``"none"`` there is Chen's
        scheme). Live activation memory is about ``L/m`` group inputs plus one group's
        residuals. Cannot be combined with :attr:`layer_policies`. Giving ``policy`` as the
        spec ``"nested:block=M,layer=SPEC"`` sets ``policy=SPEC, nest=M``.
    """

    policy: Any = "full"
    granularity: str = "block"
    scan_layers: bool = True
    layer_policies: str = ""
    nest: int | str | None = None

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown remat granularity {self.granularity!r}; valid: {', '.join(GRANULARITIES)}")
        # The one place a stack's spec is resolved (a ``nested:`` spec read): the policies are kept.
        resolved = registry.resolve_spec(self.policy)
        policy, fields = resolved.policy, resolved.stack_fields
        if fields is not None:
            if self.nest is not None:
                raise ValueError(f"policy {self.policy!r} sets the nesting; do not also give nest={self.nest!r}")
            for key, value in fields.items():
                object.__setattr__(self, key, value)
            policy = registry.resolve(self.policy)  # the layers' own spec
        object.__setattr__(self, "nest", parse_nest(self.nest))
        groups = _resolved_groups(self.layer_policies)
        if groups and self.nest is not None:
            raise ValueError(
                f"nested checkpointing (nest={self.nest!r}) checkpoints the whole layer stack and cannot be "
                f"combined with layer_policies={self.layer_policies!r}; use one or the other"
            )
        object.__setattr__(self, "_policy", policy)
        object.__setattr__(self, "_groups", groups)

    def resolved_policy(self) -> Policy:
        """The :class:`Policy` object for :attr:`policy` (resolved once, when this config was made)."""
        return self._policy  # type: ignore[attr-defined]

    def layer_groups(self, n_layers: int) -> list[tuple[int, Policy]]:
        """Contiguous ``(n_layers_in_group, policy)`` groups covering a stack of ``n_layers``.

        Groups with the same policy next to each other are kept separate (one scan each).

        Raises:
          ValueError: if the groups of :attr:`layer_policies` need more than ``n_layers`` layers.
        """
        groups = self._groups  # type: ignore[attr-defined]
        out: list[tuple[int, Policy]] = []
        used = 0
        for count, _, policy in groups:
            count = n_layers - used if count is None else count
            if used + count > n_layers:
                raise ValueError(
                    f"layer_policies={self.layer_policies!r} covers {sum(c or 0 for c, _, _ in groups)} layers, "
                    f"but the model has only {n_layers}"
                )
            if count:
                out.append((count, policy))
            used += count
        if used < n_layers:
            out.append((n_layers - used, self.resolved_policy()))
        return out

    def nest_size(self, n_layers: int) -> int | None:
        """Layers per nested group for a stack of ``n_layers`` (``None`` without nesting).

        Raises:
          ValueError: if an integer :attr:`nest` does not divide ``n_layers``.
        """
        if self.nest is None:
            return None
        divisors = [d for d in range(1, n_layers + 1) if n_layers % d == 0]
        if self.nest == "auto":
            return min(divisors, key=lambda d: (abs(d - math.sqrt(n_layers)), d))
        if self.nest not in divisors:
            raise ValueError(
                f"nested: block={self.nest} does not divide the {n_layers} layers; "
                f"valid block sizes: auto, {', '.join(map(str, divisors))}"
            )
        return self.nest

    def validate_layers(self, n_layers: int) -> None:
        """Check that this config fits a stack of ``n_layers`` layers (groups and nested block size).

        Raises:
          ValueError: if the layer groups need more layers than exist, or the nested block size
            does not divide ``n_layers``.
        """
        self.layer_groups(n_layers)
        self.nest_size(n_layers)


_GROUP_RE = re.compile(r"^\s*(\d+|rest)\s*:(.+)$")
_KEY_VALUE_RE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*=")


def parse_layer_policies(text: str) -> tuple[tuple[int | None, str], ...]:
    """Parse the per-layer-group grammar ``"COUNT:SPEC,COUNT:SPEC,...[,rest:SPEC]"``.

    Groups apply to contiguous layers in order: ``"2:full,1:dots,rest:none"`` gives layers 0-1
    ``full``, layer 2 ``dots`` and every later layer ``none``. A spec's own keys follow it with
    commas as usual (``"2:every_k:k=2,skip_cheap=true,rest:none"``): a comma-separated part that
    is ``key=value`` continues the previous group's spec. ``rest`` may appear once, last.

    Args:
      text: the grammar string; empty means no groups.

    Returns:
      ``(count, spec)`` pairs; ``count`` is ``None`` for ``rest``.

    Raises:
      ValueError: on a malformed part, a count that is not a positive integer, a misplaced
        ``rest``, a bad policy spec, or a layer-stack spec (``nested``) inside a group.
    """
    return tuple((count, spec) for count, spec, _ in _resolved_groups(text))


def _resolved_groups(text: str) -> tuple[tuple[int | None, str, Policy], ...]:
    """:func:`parse_layer_policies` with each group's policy resolved (once)."""
    if not isinstance(text, str):
        raise ValueError(f"layer_policies must be a string like '2:full,rest:none', got {text!r}")
    if not text.strip():
        return ()
    form = "expected COUNT:SPEC[,COUNT:SPEC...][,rest:SPEC], e.g. '2:full,rest:none'"
    raw: list[list[str]] = []
    for part in text.split(","):
        match = _GROUP_RE.match(part)
        if match:
            raw.append([match.group(1), match.group(2).strip()])
        elif raw and _KEY_VALUE_RE.match(part):
            raw[-1][1] += "," + part.strip()
        else:
            raise ValueError(f"malformed layer_policies {text!r}: {part!r} is not COUNT:SPEC; {form}")
    groups: list[tuple[int | None, str, Policy]] = []
    for i, (count_text, spec) in enumerate(raw):
        if count_text == "rest":
            if i != len(raw) - 1:
                raise ValueError(f"malformed layer_policies {text!r}: 'rest' must be the last group; {form}")
            count = None
        else:
            count = int(count_text)
            if count <= 0:
                raise ValueError(f"malformed layer_policies {text!r}: group size must be positive, got {count}")
        try:
            policy = registry.resolve(spec)  # a layer-stack spec (nested) is refused here too
        except ValueError as err:
            raise ValueError(f"layer_policies group {count_text}:{spec}: {err}") from None
        groups.append((count, spec, policy))
    return tuple(groups)


def remat_at(fn: Callable, level: str, config: RematConfig, *, policy: Policy | None = None) -> Callable:
    """Checkpoint ``fn`` if ``level`` is the configured granularity, else return it unchanged.

    Args:
      fn: the block or sublayer function.
      level: ``"block"`` or ``"sublayer"`` — what ``fn`` is.
      config: the :class:`RematConfig`.
      policy: overrides ``config.policy`` (used for per-layer-group policies).

    Raises:
      ValueError: if ``level`` is not ``"block"`` or ``"sublayer"``.
    """
    if level not in ("block", "sublayer"):
        raise ValueError(f"remat level must be 'block' or 'sublayer', got {level!r}")
    if config.granularity != level:
        return fn
    chosen = policy if policy is not None else config.resolved_policy()
    if isinstance(chosen, _InScan):  # run_layers knows the length of the scan
        return chosen.wrap(fn)
    # A model that scans its own layers: a scan of more than one step.
    return chosen.wrap(fn, prevent_cse=_tie.needs_tie(_MANY_STEPS if config.scan_layers else None))


#: The scan length :func:`remat_at` assumes for a ``scan_layers`` model that runs its own scan.
_MANY_STEPS = 2


class _InScan(Policy):
    """``policy`` for layers that :func:`run_layers` calls in a ``lax.scan`` of ``scan_length``
    steps (``None``: unrolled); the cotangent tie follows :func:`jremat._engine.tie.needs_tie`."""

    def __init__(self, policy: Policy, scan_length: int | None):
        self.policy = policy
        self.scan_length = scan_length
        self.spec = policy.spec

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        return self.policy.checkpoint_untied(fn, prevent_cse=_tie.needs_tie(self.scan_length))

    def wrap(self, fn, *, prevent_cse=True):
        return self.policy.wrap(fn, prevent_cse=_tie.needs_tie(self.scan_length))


def run_layers(
    make_layer_fn: Callable[[Policy], Callable],
    stacked_params: Any,
    x: jax.Array,
    keys: jax.Array | None,
    config: RematConfig,
) -> jax.Array:
    """Run a stack of identical layers, rematerialized per ``config``.

    Args:
      make_layer_fn: ``policy -> layer_fn`` where ``layer_fn(params_i, x, key_i) -> x`` already
        has :func:`remat_at` applied at its block/sublayer boundaries with that policy.
      stacked_params: pytree whose leaves have a leading layer axis.
      x: the activation entering the first layer.
      keys: per-layer keys of shape ``(n_layers,)`` (see :func:`jremat.layer_keys`) or ``None``.
      config: the :class:`RematConfig`.

    Returns:
      The activation after the last layer.

    With :attr:`RematConfig.layer_policies`, the stack is split into contiguous groups (one
    ``lax.scan`` per group under scan), each built with its own policy. With
    :attr:`RematConfig.nest` the groups of layers are checkpointed as a whole around an inner
    scan (unless the granularity is ``none``, which disables all remat).

    Raises:
      ValueError: if the layer groups or nested block size do not fit the number of layers.
    """
    with names.deferred_name_checks():  # a sublayer need not tag every name the policy lists
        return _run_layers(make_layer_fn, stacked_params, x, keys, config)


def _run_layers(make_layer_fn, stacked_params, x, keys, config):
    n_layers = jax.tree.leaves(stacked_params)[0].shape[0]
    size = config.nest_size(n_layers)
    if size is not None:
        policy = config.resolved_policy()
        if config.granularity == "none":
            return _run_stack(make_layer_fn(policy), stacked_params, x, keys, config.scan_layers)
        inner = _InScan(policy, size if config.scan_layers else None)
        return _run_nested(make_layer_fn(inner), stacked_params, x, keys, config, size)
    groups = config.layer_groups(n_layers)

    def layer_fn(group_policy: Policy, count: int) -> Callable:
        return make_layer_fn(_InScan(group_policy, count if config.scan_layers else None))

    if len(groups) == 1:
        return _run_stack(layer_fn(groups[0][1], n_layers), stacked_params, x, keys, config.scan_layers)
    sizes = tuple(count for count, _ in groups)
    param_parts = jax.tree.map(lambda a: jax.lax.split(a, sizes, axis=0), stacked_params)
    start = 0
    for g, (count, group_policy) in enumerate(groups):
        params_g = jax.tree.map(lambda parts, g=g: parts[g], param_parts, is_leaf=lambda t: isinstance(t, list))
        keys_g = None if keys is None else keys[start : start + count]
        x = _run_stack(layer_fn(group_policy, count), params_g, x, keys_g, config.scan_layers)
        start += count
    return x


def _run_stack(layer_fn: Callable, stacked_params: Any, x: jax.Array, keys: Any, scan: bool) -> jax.Array:
    """Run ``layer_fn`` over the leading layer axis of ``stacked_params`` (scan or unrolled)."""
    n_layers = jax.tree.leaves(stacked_params)[0].shape[0]
    if scan:

        def body(carry, layer_inputs):
            params_i, key_i = layer_inputs
            return layer_fn(params_i, carry, key_i), None

        x, _ = jax.lax.scan(body, x, (stacked_params, keys))
        return x
    # One split per leaf: its transpose is one concatenate. Indexing a[i] per layer would
    # transpose into a full-size padded gradient buffer per layer.
    per_layer = jax.tree.map(lambda a: jax.lax.split(a, (1,) * n_layers, axis=0), stacked_params)
    for i in range(n_layers):
        params_i = jax.tree.map(lambda parts, i=i: parts[i][0], per_layer, is_leaf=lambda t: isinstance(t, list))
        x = layer_fn(params_i, x, None if keys is None else keys[i])
    return x


def _run_nested(
    layer_fn: Callable, stacked_params: Any, x: jax.Array, keys: Any, config: RematConfig, size: int
) -> jax.Array:
    """Outer loop over groups of ``size`` layers, each group one checkpoint around an inner loop."""
    n_layers = jax.tree.leaves(stacked_params)[0].shape[0]
    n_groups = n_layers // size
    save_inputs_only = CallbackPolicy(jax.checkpoint_policies.nothing_saveable)

    def group_fn(params_g, x, keys_g):
        return _run_stack(layer_fn, params_g, x, keys_g, config.scan_layers)

    if config.scan_layers:
        grouped = jax.tree.map(lambda a: a.reshape((n_groups, size) + a.shape[1:]), stacked_params)
        grouped_keys = None if keys is None else keys.reshape((n_groups, size) + keys.shape[1:])
        checkpointed = save_inputs_only.wrap(group_fn, prevent_cse=_tie.needs_tie(n_groups))

        def body(carry, group_inputs):
            params_g, keys_g = group_inputs
            return checkpointed(params_g, carry, keys_g), None

        x, _ = jax.lax.scan(body, x, (grouped, grouped_keys))
        return x
    checkpointed = save_inputs_only.wrap(group_fn, prevent_cse=_tie.needs_tie(None))
    parts = jax.tree.map(lambda a: jax.lax.split(a, (size,) * n_groups, axis=0), stacked_params)
    for g in range(n_groups):
        params_g = jax.tree.map(lambda p, g=g: p[g], parts, is_leaf=lambda t: isinstance(t, list))
        keys_g = None if keys is None else keys[g * size : (g + 1) * size]
        x = checkpointed(params_g, x, keys_g)
    return x


def rematerialized_chunks(
    fn: Callable, params: Any, *arrays: jax.Array, n_chunks: int, axis: int = 1, reduce: bool = True
) -> jax.Array:
    """Sum of ``fn(params, *chunk)`` over ``n_chunks`` equal slices of ``arrays`` along ``axis``.

    Each chunk is checkpointed and recomputed in the backward pass, one chunk at a time (a
    ``lax.scan`` over chunks), so only one chunk's intermediates are ever live. Used for a
    language model's head and loss, whose ``[batch, seq, vocab]`` logits can dwarf the
    activations of the layers. Works in a :func:`jax.shard_map` body too (the chunks' outputs
    are the scan's outputs, not a carry, so they may vary over the mesh's axes).

    Args:
      fn: ``(params, *chunks) -> scalar`` (e.g. the summed loss of one chunk); with
        ``reduce=False``, any array (e.g. per-token statistics to combine across devices first).
      params: pytree passed whole to every chunk.
      *arrays: arrays sliced along ``axis`` (all the same length there).
      n_chunks: number of chunks; must divide the length along ``axis``.
      axis: the axis to chunk.
      reduce: ``True`` (default): return the sum over chunks; ``False``: the chunks' outputs,
        stacked on a new leading axis of ``n_chunks``.

    Returns:
      The sum over chunks (a float32 scalar), or ``[n_chunks, ...]`` outputs.

    Raises:
      ValueError: if ``n_chunks`` is not positive or does not divide the length.
    """
    length = arrays[0].shape[axis]
    if n_chunks <= 0 or length % n_chunks:
        raise ValueError(
            f"n_chunks must be a positive divisor of the length {length} along axis {axis}, got {n_chunks}"
        )

    def split(a):
        shape = a.shape[:axis] + (n_chunks, length // n_chunks) + a.shape[axis + 1 :]
        return jnp.moveaxis(a.reshape(shape), axis, 0)

    chunk_fn = CallbackPolicy(jax.checkpoint_policies.nothing_saveable).wrap(fn, prevent_cse=_tie.needs_tie(n_chunks))
    _, outputs = jax.lax.scan(lambda _, chunk: (None, chunk_fn(params, *chunk)), None, tuple(split(a) for a in arrays))
    return jnp.sum(outputs.astype(jnp.float32)) if reduce else outputs
