"""The XLA flags every compile of the suite uses, in-process and in the subprocesses it starts.

Kept apart from ``conftest`` so that a subprocess can read them before it imports JAX. Both
flags change only LLVM code generation: not buffer assignment, so no memory figure, and not
the values computed. Their effect on compile time is in docs/xla-notes.md.
"""

#: Backend optimization level 0, and one LLVM module per program instead of several compiled on
#: threads that a 2-core runner busy with two test workers does not have.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
