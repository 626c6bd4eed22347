"""Attention: memory-efficient attention whose residuals carry names (:mod:`.functions`, public
as :mod:`jremat.attention`), the checks of its inputs (:mod:`.inputs`), and where a traced
program's attention core and fused forward passes are (:mod:`.analysis`).

Imports: :mod:`jremat._spec`, :mod:`jremat._engine`, :mod:`jremat._program`.
"""
