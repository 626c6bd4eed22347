"""The devices a pytree's shardings span: how many (a mesh's size per step) and which."""

from __future__ import annotations

import jax


def mesh_device_set(tree) -> tuple:
    """The devices the shardings of ``tree``'s leaves (arrays, shape structs or shardings) span,
    sorted by id (``()``: nothing sharded)."""
    found = set()
    for leaf in jax.tree.leaves(tree):
        sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        found |= set(getattr(sharding, "device_set", ()))
    return tuple(sorted(found, key=lambda d: d.id))


def mesh_devices(tree) -> int:
    """How many devices the shardings of a pytree of arrays or shape structs span (1: no mesh)."""
    return max(len(mesh_device_set(tree)), 1)


__all__ = ["mesh_device_set", "mesh_devices"]
