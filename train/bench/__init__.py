"""Memory and time of every remat policy and its peers: ``python -m train.bench``.

One run writes one CSV per part (``bench-<part>.csv``, of exactly that part's columns) and PNG
plots into ``--out`` (default ``docs/results/``) and regenerates ``--report`` (default
``docs/RESULTS.md``): the verdict table, the exact command, the machine, the JAX version and the
date. Parts (``--parts``; :data:`~train.bench.parts.BENCH_PARTS`, one
:class:`~train.bench.part.Part` each):

``needle`` / ``needle_time``
    The Needle study's figures: Adam-step peak of ``every_k:k=4`` vs ``none`` against batch and
    ``d_ff`` (blocks only, chunked head only, whole step), and step time against k.
``megatron``
    Per-layer saved activations next to Megatron-LM's formulas, and the analytic peak estimate
    (:func:`train.programs.analytic_peak_bytes`) against the compiled peak.
``maxbatch``
    The largest batch whose compiled Adam-step peak fits a budget.
``time``
    Step time (as a ratio to ``none`` and absolute: tokens/s, model TFLOP/s, MFU), FLOPs bound,
    peak and compile time per policy, on a head-dominated and a block-dominated model.
``peers``
    ``jax.checkpoint``, ``flax.nnx.remat``, Linen ``nn.remat`` / ``nn.remat_scan`` next to the
    jremat policy that does the same (:mod:`train.bench.peers`).
``auto``
    ``auto`` plans at budgets between ``full``'s and ``none``'s peak, timed against the built-ins.

Modules: :mod:`~train.bench.config` (what runs, the command line), :mod:`~train.bench.harness`
(compiling, memory, FLOPs, paired timing), :mod:`~train.bench.flops` (model FLOPs, tokens/s, MFU),
:mod:`~train.bench.peers` (the peer programs), :mod:`~train.bench.part` (what a part is: its run,
columns, targets with their miss notes, tables), one ``part_<name>`` module per part,
:mod:`~train.bench.parts` (the parts in run order), :mod:`~train.bench.timed` (timed rows),
:mod:`~train.bench.rows` (columns, CSV), :mod:`~train.bench.markdown` (cell formatting),
:mod:`~train.bench.report` (verdict, markdown), :mod:`~train.bench.plots`.
"""

if __name__ != "jremat.train.bench":  # run from a checkout as `python -m train.bench`
    from jremat.internal import alias_installed

    alias_installed(__name__)
