"""The public surface of ``jremat``: the names of ``__all__`` and a few public submodules, no module
shadowing a public name."""

import importlib
import pkgutil
import types

import jremat

#: Submodules users import by name; every other module of the package is private (``jremat._...``).
PUBLIC_SUBMODULES = {"names", "ops", "attention", "kernels", "registry", "testing", "pytest_plugin"}
#: Packages that a checkout keeps in folders of their own (policies/, models/, train/).
MAPPED_PACKAGES = {"policies", "models", "train"}


def test_every_name_in_all_resolves():
    assert len(jremat.__all__) == len(set(jremat.__all__))
    for name in jremat.__all__:
        assert hasattr(jremat, name), name


def test_no_public_attribute_is_a_private_module():
    for name in PUBLIC_SUBMODULES | MAPPED_PACKAGES:
        importlib.import_module(f"jremat.{name}")
    public = [name for name in dir(jremat) if name.isidentifier() and not name.startswith("_")]
    modules = {name for name in public if isinstance(getattr(jremat, name), types.ModuleType)}
    assert modules <= PUBLIC_SUBMODULES | MAPPED_PACKAGES


def test_every_other_module_is_private():
    found = {info.name for info in pkgutil.iter_modules(jremat.__path__)}
    assert PUBLIC_SUBMODULES <= found
    assert {name for name in found - PUBLIC_SUBMODULES if not name.startswith("_")} == set()


def test_decorator_and_explain_are_the_functions():
    assert callable(jremat.policy) and not isinstance(jremat.policy, types.ModuleType)
    assert callable(jremat.explain) and not isinstance(jremat.explain, types.ModuleType)
    found = {info.name for info in pkgutil.iter_modules(jremat.__path__)}
    assert not found & {"policy", "explain"}
