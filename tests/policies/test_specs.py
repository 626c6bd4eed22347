"""Bad policy specs raise ValueError naming the bad part and the valid choices."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat import require_host_memory


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bogus", r"unknown policy 'bogus'; valid policies: .*every_k.*selective"),
        ("every_k:k=0", r"policy 'every_k': k must be >= 1, got '0'"),
        ("every_k:k=-3", r"policy 'every_k': k must be >= 1, got '-3'"),
        ("every_k:k=abc", r"policy 'every_k': k must be an integer, got 'abc'"),
        ("skip_cheap:min_flops_per_byte=nan", r"policy 'skip_cheap': min_flops_per_byte must be a finite number"),
        ("skip_cheap:min_flops_per_byte=inf", r"policy 'skip_cheap': min_flops_per_byte must be a finite number"),
        ("every_k:min_flops_per_byte=-inf", r"policy 'every_k': min_flops_per_byte must be a finite number"),
        ("every_k:j=2", r"unknown key 'j' for policy 'every_k'; valid keys: k, skip_cheap, min_flops_per_byte"),
        ("full:k=2", r"unknown key 'k' for policy 'full'; valid keys: keep_gathered"),
        ("every_k:k", r"malformed policy spec 'every_k:k': 'k' is not key=value"),
        ("every_k:", r"malformed policy spec 'every_k:': nothing after ':'"),
        ("every k", r"malformed policy spec 'every k': bad name"),
        ("names", r"policy 'names' needs key 'save'"),
        ("offload:names=q+k,save=k+v", r"policy 'offload': 'k' listed both to offload \(names=\) and to save"),
        ("nested:block=0", r"policy 'nested': block must be 'auto' or a positive integer, got '0'"),
        ("nested:layer=bogus", r"policy 'nested': layer='bogus': unknown policy 'bogus'"),
    ],
)
def test_bad_spec_raises(spec, message):
    with pytest.raises(ValueError, match=message):
        jremat.resolve(spec)


def test_keys_given_separately_are_validated_too():
    with pytest.raises(ValueError, match="k must be >= 1"):
        jremat.resolve("every_k", k=0)
    assert jremat.resolve("every_k", k=3).spec == "every_k:k=3"


def test_names_policy_specs_round_trip():
    assert jremat.resolve("names:save=q+k").spec == "names:save=q+k"
    assert jremat.resolve("offload:names=q,save=v").spec == "offload:names=q,save=v"
    assert jremat.registry.normalize_spec("nested:block=2,layer=every_k:k=2;skip_cheap=true") == (
        "nested:block=2,layer=every_k:k=2;skip_cheap=true"
    )


class _DeviceWithoutHost:
    platform = "fake"

    def addressable_memories(self):
        class Memory:
            kind = "device"

        return [Memory()]

    def __str__(self):
        return "FakeDevice"


def test_offload_on_backend_without_host_memory_raises(monkeypatch):
    policy = jremat.resolve("offload:names=q")  # this backend has pinned_host
    require_host_memory("pinned_host")
    monkeypatch.setattr(jax, "devices", lambda *a: [_DeviceWithoutHost()])
    with pytest.raises(ValueError, match=r"offload needs memory kind 'pinned_host'.*only has device"):
        jremat.resolve("offload:names=q")
    with pytest.raises(ValueError, match=r"offload needs memory kind 'pinned_host'"):
        policy.wrap(jnp.sin)


def test_describe_lists_every_policy():
    text = jremat.describe()
    for name in jremat.available():
        assert f"  {name}" in text


def test_describe_one_policy_gives_its_keys_and_an_example_that_resolves():
    text = jremat.describe("every_k")
    assert text.startswith("every_k: ")
    assert "    k=<int>  default 4, >= 1: save one compute op in every k" in text
    assert "    skip_cheap=<bool>  default false: " in text
    example = text.splitlines()[-1].removeprefix("  example: ")
    assert example == "every_k:k=4,skip_cheap=false,min_flops_per_byte=8.0"
    assert jremat.resolve(example).spec == example
    assert "keys: none" in jremat.describe("full")
    assert jremat.describe("names").splitlines()[-1] == "  example: names:save=<names>  (fill in each <...>)"
    assert "layer stack" in jremat.describe("nested")
    for name in jremat.available():  # every entry, built-in or not, describes itself
        assert jremat.describe(name).startswith(f"{name}: ")


def test_describe_reads_a_name_with_spaces_around_as_resolve_does():
    assert jremat.describe(" every_k ") == jremat.describe("every_k")
    assert jremat.resolve(" every_k ").spec == "every_k"
    with pytest.raises(ValueError, match=r"not a spec: describe\('every_k'\)"):
        jremat.describe(" every_k:k=2 ")


def test_describe_refuses_what_is_not_a_policy_name():
    with pytest.raises(ValueError, match=r"unknown policy 'every_kk'; valid policies: .*every_k"):
        jremat.describe("every_kk")
    with pytest.raises(ValueError, match=r"not a spec: describe\('every_k'\)"):
        jremat.describe("every_k:k=2")
    with pytest.raises(TypeError, match="policy name"):
        jremat.describe(jremat.resolve("full"))


def test_scoped_registry_restores_what_it_found():
    from jremat import registry

    before = registry.entries()
    with pytest.raises(RuntimeError), registry.scoped():
        registry.register("test_scoped_policy", doc="scoped")(lambda: jremat.resolve("full"))
        registry.unregister("every_k")
        assert "test_scoped_policy" in registry.available() and "every_k" not in registry.available()
        raise RuntimeError
    assert registry.entries() == before
