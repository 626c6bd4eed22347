"""Measurements of compiled programs: the XLA options under which remat's saving survives
(:mod:`.compile`), compiled memory and byte formatting (:mod:`.memory`), the memory timeline
over the compiled schedule (:mod:`.timeline`, :mod:`.timeline_buffers`, :mod:`.timeline_data`),
collectives on a mesh and the devices of a mesh (:mod:`.collectives`, :mod:`.shards`), the
allocator's live peak (:mod:`.live`), host memory for offloading (:mod:`.host_offload`) and
XLA's optimized HLO (:mod:`.xla_dump`).

Imports: :mod:`jremat._spec`, :mod:`jremat._engine`.
"""
