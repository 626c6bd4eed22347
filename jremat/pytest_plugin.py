"""The jremat pytest plugin: a ``remat_exact`` fixture that checks a model under every policy.

Installed with jremat and loaded by pytest through the ``pytest11`` entry point, so a test
suite needs no ``conftest.py`` and no import of it::

    def test_my_model_is_exact_under_remat(remat_exact):
        remat_exact(loss, params, x)    # jremat.testing.assert_remat_exact under one policy

A test that asks for ``remat_exact`` runs once per registered policy
(:func:`jremat.testing.policies`); policies that cannot apply are reported as skipped with
the reason. ``@pytest.mark.remat_policies(tags=[...], examples={...})`` passes the tensor names
of the model (for the name-based policies) and example specs on to
:func:`jremat.testing.policies`. The fixture's ``policy`` attribute is the spec under test.

The ``jremat_registry`` fixture gives the policy registry and restores it when the test ends
(:func:`jremat.registry.scoped`), so a test can register policies without leaving them behind.

Nothing is imported from JAX until a test uses the fixture.
"""

from __future__ import annotations

import pytest

MARKER = "remat_policies"


def pytest_configure(config):
    """Register the ``remat_policies`` marker."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(tags=(), examples=None): checkpoint_name tags and example specs from which the "
        "remat_exact fixture builds one test per registered jremat policy",
    )


def _explicitly_parametrized(metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "remat_exact" in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    """Run every test that uses ``remat_exact`` once per registered policy."""
    if "remat_exact" not in metafunc.fixturenames or _explicitly_parametrized(metafunc):
        return
    from jremat.testing import policies

    marker = metafunc.definition.get_closest_marker(MARKER)
    options = dict(marker.kwargs) if marker else {}
    unknown = sorted(set(options) - {"tags", "examples"})
    if unknown or (marker and marker.args):
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER} takes the keywords tags= and examples=, got "
            f"{', '.join(map(repr, marker.args))}{', ' if marker.args and unknown else ''}{', '.join(unknown)}"
        )
    try:
        params = policies(**options)
    except ValueError as err:
        raise pytest.UsageError(f"@pytest.mark.{MARKER} on {metafunc.definition.nodeid}: {err}") from None
    metafunc.parametrize("remat_exact", params, indirect=True)


class RematExact:
    """``remat_exact(fn, *args, **kwargs)``: :func:`jremat.testing.assert_remat_exact` under :attr:`policy`."""

    def __init__(self, policy: str):
        self.policy = policy

    def __call__(self, fn, *args, **kwargs):
        from jremat import PolicyDoesNotApply
        from jremat.testing import assert_remat_exact

        try:
            return assert_remat_exact(fn, self.policy, *args, **kwargs)
        except PolicyDoesNotApply as err:  # e.g. selective on a model without attention
            pytest.skip(f"policy {self.policy!r} does not apply to this function: {err}")

    def __repr__(self) -> str:
        return f"<remat_exact under {self.policy!r}>"


@pytest.fixture
def remat_exact(request) -> RematExact:
    """Check a function or module with and without remat under one registered policy per test run."""
    policy = getattr(request, "param", None)
    if policy is None:
        raise pytest.UsageError(
            "the remat_exact fixture is parametrized by the jremat plugin; parametrize it yourself "
            "with indirect=True and a policy spec, or let the plugin do it"
        )
    return RematExact(policy)


@pytest.fixture
def jremat_registry():
    """The policy registry (:mod:`jremat.registry`), restored when the test ends.

    Policies a test registers (``jremat_registry.register(...)``, ``@jremat.custom_policy``,
    ``--policy-module``) are gone afterwards, whatever order the tests run in.
    """
    from jremat import registry

    with registry.scoped():
        yield registry
