"""``nested``: √n checkpointing over the layer stack (Chen et al. 2016; Haliax's ``nested`` scan).

``nested:block=auto`` cuts the ``L`` layers into groups of ``m`` consecutive layers (``auto``:
the divisor of ``L`` closest to ``√L``; or an integer that divides ``L``). The outer scan runs
the groups; each group is one checkpoint that saves only its input activation, around an inner
scan over the group's layers. The ``layer=`` key is the per-layer policy inside a group, applied
at the configured granularity (block or sublayer): the default ``none`` is Chen's scheme (a
recomputed group keeps all its activations while its backward runs); ``layer=full`` adds a
second level (one saved input per layer of the group being differentiated). Write the inner
spec's own commas as ``;``: ``nested:block=2,layer=every_k:k=2;skip_cheap=true``.

It is a layer-stack entry (``stack=True``), not a policy of one function: it stands for
``jremat.RematConfig(policy=LAYER, nest=BLOCK)`` and is accepted where a stack's policy is given
(``RematConfig``, ``run_layers``, the train CLIs' ``--policy``), not by ``jremat.checkpoint`` nor inside
``layer_policies`` groups.
"""

from __future__ import annotations

from jremat import register
from jremat.internal import BUILTIN_PARAMS


@register(
    "nested",
    doc="Stack-level sqrt(n) checkpointing: groups of block= consecutive layers (auto: the divisor of L "
    "closest to sqrt(L)) each save only their input; inside a group each layer uses layer= (default "
    "none: all of the group's activations while it is differentiated).",
    params=BUILTIN_PARAMS["nested"],
    stack=True,
)
def nested_policy(block, layer: str) -> dict:
    """The :class:`jremat.RematConfig` fields of ``nested``: the per-layer policy and the group size."""
    return {"policy": layer.replace(";", ","), "nest": BUILTIN_PARAMS["nested"]["block"].parse(str(block))}
