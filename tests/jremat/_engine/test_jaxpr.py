"""jremat._engine.jaxpr: the one home of primitive names (no literal elsewhere), the walk over nested
jaxprs with the loops around each equation, and liveness through calls and scans."""

import ast
import functools
import gc
import pathlib

import jax
import jax.experimental.pallas  # its primitives join the vocabulary below
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive

from jremat._engine import jaxpr as _jaxpr


@jax.custom_jvp
def first_of(value, ignored):
    """Returns ``value``; ``ignored`` only feeds the JVP (the shape of remat3's saved-value call)."""
    return value


first_of.defjvp(lambda primals, tangents: (primals[0], tangents[1]))


def test_an_input_only_an_ignoring_call_reads_is_dead():
    def fn(a, b):
        return first_of(a * 2.0, jnp.sin(b))

    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(1.0, 2.0)) == [True, False]


def test_a_scan_reads_what_its_body_reads_and_carries_reach_a_fixed_point():
    def fn(c0, c1, xs, ys):
        def body(carry, x_y):
            a, b = carry
            x, y = x_y
            return (a + x, a * 2.0), first_of(b, y)  # b is the previous a; y feeds nothing

        (a, b), out = jax.lax.scan(body, (c0, c1), (xs, ys))
        return b, out

    xs = jnp.ones(3)
    # b (an output) is the previous a: a's initial value and every x are read; c1 is read as the
    # first b; ys never.
    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(0.0, 0.0, xs, xs)) == [True, True, True, False]


def test_used_outputs_select_what_is_live():
    def fn(a, b):
        return a + 1.0, b * 3.0

    jaxpr = jax.make_jaxpr(fn)(1.0, 2.0)
    assert _jaxpr.used_inputs(jaxpr, [True, False]) == [True, False]
    assert _jaxpr.used_inputs(jaxpr, [False, True]) == [False, True]


def test_effects_keep_an_equation_live():
    def fn(a, b):
        jax.debug.print("{}", b)
        return a

    assert _jaxpr.used_inputs(jax.make_jaxpr(fn)(1.0, 2.0)) == [True, True]


def test_a_dead_equation_is_not_live_and_a_call_body_is_walked_with_its_used_outputs():
    @jax.jit
    def inner(a, b):
        return jnp.sin(a), jnp.cos(b)

    def fn(a, b):
        kept, _ = inner(a, b)
        jnp.exp(b)  # dead
        return kept

    found = list(_jaxpr.live_equations(jax.make_jaxpr(fn)(1.0, 2.0)))
    names = [eqn.primitive.name for eqn, _, _ in found]
    assert "exp" not in names and "cos" not in names
    assert "sin" in names
    call = next(eqn for eqn, _, _ in found if _jaxpr.call_jaxpr(eqn) is not None)
    used_of = {eqn.primitive.name: (used, enclosing) for eqn, used, enclosing in found}
    assert used_of["sin"] == ([True], (call,))
    assert next(used for eqn, used, _ in found if eqn is call) == [True, False]


# ---------------------------------------------------------------------------------------------
# The walk


def _tagged_everywhere(x, xs):
    """A tag at the top, inside a jit call, inside scan(3) > scan(2), and inside a while loop in the scan."""

    @jax.jit
    def called(v):
        return checkpoint_name(v * 2.0, "in_call")

    def inner(c, _):
        return checkpoint_name(c + 1.0, "in_inner_scan"), None

    def outer(c, x):
        c, _ = jax.lax.scan(inner, c, None, length=2)
        c = jax.lax.while_loop(lambda v: v < 0.0, lambda v: checkpoint_name(v + 1.0, "in_while"), c)
        return c + x, None

    y, _ = jax.lax.scan(outer, called(checkpoint_name(x, "top")), xs)
    return y


def test_walk_gives_each_equation_the_loops_around_it_and_their_trip_count(classic_engine):
    # classic: a checkpoint_name tag is a `name` equation (name_tag reads it)
    jaxpr = jax.make_jaxpr(_tagged_everywhere)(1.0, jnp.ones(3))
    where = {
        _jaxpr.name_tag(eqn): ([loop.params["length"] for loop in _jaxpr.loops(enclosing)], enclosing)
        for eqn, enclosing in _jaxpr.walk(jaxpr)
        if _jaxpr.name_tag(eqn) is not None
    }
    assert {tag: lengths for tag, (lengths, _) in where.items()} == {
        "top": [],
        "in_call": [],
        "in_inner_scan": [3, 2],
        "in_while": [3],  # a while loop's trip count is unknown: it adds no loop
    }
    trips = {tag: _jaxpr.trip_count(enclosing) for tag, (_, enclosing) in where.items()}
    assert trips == {"top": 1, "in_call": 1, "in_inner_scan": 6, "in_while": 3}
    # What holds each equation, outermost first: the call, the while loop.
    (call,) = where["in_call"][1]
    assert call.primitive.name in _jaxpr.INLINED_CALL_PRIMITIVES
    assert [e.primitive.name for e in where["in_while"][1]] == ["scan", "while"]
    assert _jaxpr.name_tags(jaxpr) == {"top", "in_call", "in_inner_scan", "in_while"}


def test_walk_visits_an_equation_before_its_body_and_enter_stops_the_descent(classic_engine):
    jaxpr = jax.make_jaxpr(_tagged_everywhere)(1.0, jnp.ones(3))
    order = [eqn.primitive.name for eqn in _jaxpr.equations(jaxpr)]
    call = next(i for i, name in enumerate(order) if name in _jaxpr.INLINED_CALL_PRIMITIVES)
    assert call < order.index("mul") and order.index("while") < order.index("lt")
    not_into_scans = lambda eqn, _: not _jaxpr.is_scan(eqn)
    tags = {_jaxpr.name_tag(e) for e in _jaxpr.equations(jaxpr, enter=not_into_scans)} - {None}
    assert tags == {"top", "in_call"}


# ---------------------------------------------------------------------------------------------
# No primitive-name literal outside jremat/_engine/jaxpr.py

ROOT = pathlib.Path(__file__).resolve().parents[3]
#: Where the rule holds.
CHECKED = ("jremat", "policies", "models", "train")


@functools.cache  # a walk over every object the process holds: once
def _vocabulary() -> frozenset[str]:
    """Every primitive name: JAX's primitives (those of the modules imported here) and _jaxpr's."""
    names = {o.name for o in gc.get_objects() if isinstance(o, Primitive)}
    for attribute, value in vars(_jaxpr).items():
        if not attribute.isupper() or attribute.startswith("_"):
            continue
        if isinstance(value, str):
            names.add(value)
        elif isinstance(value, (frozenset, dict)) and all(isinstance(v, str) for v in value):
            names.update(value)
    names.discard(_jaxpr.REDUCE_PREFIX)
    return frozenset(names)


def primitive_literals(source: str, vocabulary: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, literal)`` of every primitive name written as a string literal where it names a
    primitive: compared with (or looked up by) a primitive's name (``eqn.primitive.name``, a
    variable assigned from one, ``op.primitive``), gathered in a set, tuple, list or dict of
    primitive names only, or bound to an upper-case constant."""
    tree = ast.parse(source)
    # Variables that hold a primitive (or a count by primitive): assigned from an expression that reads one.
    reads_primitive_vars = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and "primitive" in ast.unparse(node.value)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def reads_primitive(node) -> bool:
        text = ast.unparse(node)
        return (
            text.endswith((".primitive", ".primitive.name", "prim.name"))
            or text == "prim"
            or (isinstance(node, ast.Name) and node.id in reads_primitive_vars)
        )

    def literals(node) -> list:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node]
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            return [e for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(reads_primitive(o) for o in operands):
                found += [c for o in operands for c in literals(o) if c.value in vocabulary]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and reads_primitive(node.value):
            found += [c for c in literals(node.slice) if c.value in vocabulary]
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)) and node.elts:
            items = literals(node)
            if len(items) == len(node.elts) and all(c.value in vocabulary for c in items):
                found += items
        elif isinstance(node, ast.Dict) and len(node.keys) >= 2:
            keys = [k for k in node.keys if k is not None]
            items = [k for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len(items) == len(node.keys) and all(c.value in vocabulary for c in items):
                found += items
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            upper = [t for t in node.targets if isinstance(t, ast.Name) and t.id.lstrip("_").isupper()]
            if upper and isinstance(node.value.value, str) and node.value.value in vocabulary:
                found.append(node.value)
    return sorted({(c.lineno, c.value) for c in found})


def test_no_primitive_name_literal_outside_the_jaxpr_module():
    vocabulary = _vocabulary()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {literal!r}"
        for root in CHECKED
        for path in sorted((ROOT / root).rglob("*.py"))
        if path != ROOT / "jremat" / "_engine" / "jaxpr.py"
        for line, literal in primitive_literals(path.read_text(), vocabulary)
    ]
    assert found == [], "name these primitives in jremat/_engine/jaxpr.py and use its constants:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'if eqn.primitive.name == "scan": pass',
        'if eqn.primitive.name in ("while", "scan"): pass',
        'name = eqn.primitive.name\nif name == "dot_general": pass',
        'prims = Counter(e.primitive.name for e in eqns)\nn = prims["exp"]',
        'LOOPS = frozenset({"scan", "while"})',
        '_CUSTOM_VJP = "custom_vjp_call"',
        'FOLDS = {"add": 1, "mul": 2}',
        'def f(prim):\n    return prim.name == "name"',
        'keep = op.primitive == "name"',
    ],
)
def test_the_check_finds_a_primitive_name_literal(source):
    assert primitive_literals(source, _vocabulary()) != []


@pytest.mark.parametrize(
    "source",
    [
        'tag = eqn.params["name"]',  # a parameter, not a primitive
        'if opcode == "while": pass',  # an HLO opcode
        'if f.name not in ("parent", "name"): pass',
        'KIND = "blockwise"',
        "if eqn.primitive.name == _jaxpr.SCAN: pass",
    ],
)
def test_the_check_leaves_other_strings_alone(source):
    assert primitive_literals(source, _vocabulary()) == []
