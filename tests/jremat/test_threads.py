"""First use from many threads at once: every lazily built global (the policy registry, its
built-ins and entry points, the engine probe, the remat3 primitives, trace caches, the lazy
``jremat.<name>``) is complete for every thread, whichever asks first.

Each run is a fresh Python process, since one that has looked a policy up before has nothing
left to race on; its threads are released together by a barrier.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._engine.cache import BoundedCache
from tests.conftest import REPO

#: One process: ``THREADS`` threads whose first act is a lookup, each reporting what it saw.
FIRST_USE_SCRIPT = r"""
import json, sys, threading

import jremat

threads = int(sys.argv[1])
public = sorted(jremat.__all__)
barrier = threading.Barrier(threads)
seen = [None] * threads


def first_use(i):
    barrier.wait()
    try:
        role = i % 5
        if role == 0:
            jremat.resolve("full")
            seen[i] = ("names", jremat.available())
        elif role == 1:
            jremat.checkpoint(lambda x: x, "full")
            seen[i] = ("names", jremat.available())
        elif role == 2:
            seen[i] = ("names", jremat.available())
        elif role == 3:
            import jax

            remat_sin = jremat.checkpoint(lambda x: jax.numpy.sin(jax.numpy.sin(x) * x), "every_k:k=1")
            seen[i] = ("grad", float(jax.grad(remat_sin)(1.0)))
        else:
            getattr(jremat, public[i % len(public)])
            seen[i] = ("names", list(jremat.registry.entries()))
    except Exception as err:
        seen[i] = ("error", f"{type(err).__name__}: {err}")


workers = [threading.Thread(target=first_use, args=(i,)) for i in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
print(json.dumps({"seen": seen, "names": jremat.available()}))
"""


def run_first_use(threads: int, processes: int, engine_env: dict[str, str]) -> list[str]:
    """Start ``processes`` fresh processes of ``threads`` racing threads (a few at a time);
    return one line per thread that failed or saw a registry other than the final one."""
    env = {**os.environ, **engine_env}
    failures = []
    batch = 4
    for start in range(0, processes, batch):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", FIRST_USE_SCRIPT, str(threads)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(start, min(start + batch, processes))
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                failures.append(f"process exited {proc.returncode}: {err.strip().splitlines()[-1:]}")
                continue
            result = json.loads(out.strip().splitlines()[-1])
            grads = set()
            for i, (kind, value) in enumerate(result["seen"]):
                if kind == "error":
                    failures.append(f"thread {i}: {value}")
                elif kind == "names" and sorted(value) != result["names"]:
                    failures.append(f"thread {i} saw policies {sorted(value)}, not {result['names']}")
                elif kind == "grad":
                    grads.add(value)
            if len(grads) > 1:
                failures.append(f"threads computed different gradients: {sorted(grads)}")
    return failures


ENGINES = {"classic": {"JAX_REMAT3": "0"}, "remat3": {"JAX_REMAT3": "1"}}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.heavy
def test_first_lookup_from_many_threads(engine):
    failures = run_first_use(threads=32, processes=3, engine_env=ENGINES[engine])
    assert not failures, "\n".join(failures[:10])


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_first_lookup_from_many_threads_many_processes(engine):
    failures = run_first_use(threads=32, processes=50, engine_env=ENGINES[engine])
    assert not failures, "\n".join(failures[:10])


def test_bounded_cache_one_value_per_key_under_threads():
    cache = BoundedCache(maxsize=4)
    threads = 16
    barrier = threading.Barrier(threads)
    errors = []

    def fill(i):
        barrier.wait()
        try:
            for step in range(200):
                cache.get((i + step) % 6, object)
        except Exception as err:  # eviction racing a lookup
            errors.append(err)

    workers = [threading.Thread(target=fill, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert len(cache) <= 4
    key = object()
    first = cache.get(key, lambda: "first")
    assert cache.get(key, lambda: "second") == first == "first"
    assert cache.get("kept-out", lambda: "a", keep=lambda v: False) == "a"
    assert cache.get("kept-out", lambda: "b") == "b"  # a value not kept is built again


def test_registry_built_ins_load_again_after_a_failed_load(monkeypatch):
    """The loaded flag is set only once loading succeeded: a failing entry point raises on each lookup."""
    from jremat._apply import registry

    class BrokenEntryPoint:
        def load(self):
            raise ImportError("broken plugin")

    monkeypatch.setattr(registry, "_builtins_loaded", False)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [BrokenEntryPoint()])
    for _ in range(2):
        with pytest.raises(ImportError, match="broken plugin"):
            jremat.available()
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    assert "full" in jremat.available()
    assert registry._builtins_loaded


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.heavy
def test_one_function_traced_for_many_shapes_from_many_threads(filtered, monkeypatch):
    """More shapes than a decorated function keeps traces for, from several threads at once:
    evictions race one another and lookups, yet every call succeeds with its own result."""
    from jremat._apply import decorated_call as _decorated_call

    monkeypatch.setattr(_decorated_call, "_MAX_TRACES", 2)  # every new shape evicts
    # Many static values, each hashed by Python code: an eviction's lookup of its key is long
    # enough for other threads to evict in between.
    statics = tuple(range(1, 61))
    scaled_sin = lambda x, *scales: jnp.sin(x) * len(scales)
    if filtered:
        fn = jremat.filter_checkpoint(scaled_sin, "full")
    else:
        fn = jremat.checkpoint(scaled_sin, "full", static_argnums=tuple(range(1, len(statics) + 1)))
    double_sin = lambda x: fn(x, *statics) / len(statics) * 2
    threads, shapes, steps = 8, 6, 60  # a cache that evicts without its lock fails here every time
    barrier = threading.Barrier(threads)
    errors, wrong = [], []

    def trace_many(i):
        barrier.wait()
        try:
            for step in range(steps):
                n = 1 + (i + step) % shapes
                out = jax.eval_shape(lambda x: double_sin(x), jax.ShapeDtypeStruct((n,), jnp.float32))  # a new trace
                if out.shape != (n,):
                    wrong.append((i, n, out.shape))
            x = jnp.full((1 + i % shapes,), 0.5 + i)
            if not np.allclose(double_sin(x), np.sin(0.5 + i) * 2, rtol=1e-6):
                wrong.append((i, "value"))
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: evictions interleave
    try:
        workers = [threading.Thread(target=trace_many, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]


#: One process: thread B imports the plugin module ``plug`` (an entry point of the policy group),
#: whose body looks a policy up; meanwhile thread A's first lookup loads the entry points (and so
#: imports ``plug``), and thread C's first lookup must see ``plug``'s policy. Events force the
#: order, no sleep: A and C look up while B is inside ``plug``'s body, and B looks up only once
#: both wait on Python's import lock for ``plug`` (their innermost frame is importlib's lock
#: ``acquire``).
PLUGIN_SCRIPT = r"""
import builtins, importlib, os, sys, threading, time

sys.path.insert(0, sys.argv[1])
import jremat
import jremat.policies  # the built-ins imported already: A goes straight to the entry point
from jremat._apply import registry


class PlugEntryPoint:
    module = "plug"

    def load(self):
        return importlib.import_module("plug")


registry.importlib.metadata.entry_points = lambda group: [PlugEntryPoint()]
builtins.plug_inside = threading.Event()
builtins.plug_may_look_up = threading.Event()
seen = {}


def record(name, fn):
    def run():
        try:
            seen[name] = fn()
        except Exception as err:
            seen[name] = f"{type(err).__name__}: {err}"
    return threading.Thread(target=run, name=name, daemon=True)


def first_lookup():
    builtins.plug_inside.wait()
    return sorted(jremat.available())


def b_imports_plug():
    import plug

    return plug.resolved


def waits_for_an_import(thread):
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == "acquire" and "importlib" in frame.f_code.co_filename


b = record("B", b_imports_plug)
a, c = record("A", first_lookup), record("C", first_lookup)
for thread in (b, a, c):
    thread.start()
builtins.plug_inside.wait()
deadline = time.monotonic() + 60  # a hang guard, not a speed claim
while not (waits_for_an_import(a) and waits_for_an_import(c)):  # A and C wait for plug's import
    if time.monotonic() > deadline:
        print("threads A and C never waited for plug's import", flush=True)
        os._exit(4)
    time.sleep(0.001)
builtins.plug_may_look_up.set()
for thread in (a, b, c):
    thread.join(timeout=20)
    if thread.is_alive():
        print(f"deadlock: thread {thread.name} still waits", flush=True)
        os._exit(3)
print(repr(seen))
"""

PLUGIN_MODULE = """
import builtins

import jremat

jremat.register("plugged", doc="registered by the plugin")(lambda: jremat.resolve("full"))
builtins.plug_inside.set()
builtins.plug_may_look_up.wait()
resolved = jremat.resolve("full").spec  # a lookup while this module is being imported
"""


def test_a_plugin_that_looks_up_at_import_does_not_deadlock_a_first_lookup(tmp_path):
    """No lock of jremat is held while an entry point's module is imported: a plugin whose import
    (in one thread) looks a policy up completes while other threads' first lookups wait for that
    import, and those lookups see the plugin's policies."""
    (tmp_path / "plug.py").write_text(PLUGIN_MODULE)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PLUGIN_SCRIPT, str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    seen = eval(proc.stdout.strip().splitlines()[-1])
    assert seen["B"] == "full"
    for first in ("A", "C"):
        assert "plugged" in seen[first] and "full" in seen[first], seen[first]


def test_a_plugin_that_fails_after_registering_reports_its_own_error_again(monkeypatch, tmp_path):
    """An entry point whose module registers a policy and then raises: every lookup raises the
    plugin's error, not the retry's 'already registered'."""
    from jremat._apply import registry

    (tmp_path / "half_plug.py").write_text(
        'import jremat\njremat.register("half", doc="half")(lambda: None)\nraise RuntimeError("half_plug is broken")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "half_plug", raising=False)
    entry_point = importlib.metadata.EntryPoint(name="half", value="half_plug", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_builtins_loaded", False)
    monkeypatch.setattr(registry, "_FAILED_LOADS", {})
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [entry_point])
    for _ in range(3):
        with pytest.raises(RuntimeError, match="half_plug is broken"):
            jremat.available()
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    assert "full" in jremat.available()


def test_the_modules_jremat_imports_without_serializing_jax_import_no_jax():
    """``jremat.<name>`` imports JAX one thread at a time before the module behind the name,
    except for the modules listed as JAX-free: each of those must import no JAX."""
    script = (
        "import importlib, json, sys\n"
        "import jremat\n"
        "found = {}\n"
        "for module in sorted(jremat._JAX_FREE):\n"
        "    importlib.import_module(module)\n"
        "    found[module] = 'jax' in sys.modules\n"
        "print(json.dumps(found))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found and not any(found.values()), found
