"""Explanation: what a policy did to a function and why (:mod:`.explain`, :mod:`.explanation`,
:mod:`.decisions`, :mod:`.memory`), the residuals it saves (:mod:`.residuals`) and whether its
gradients are exactly those without remat (:mod:`.exactness`).

Imports: every room below it (up to :mod:`jremat._apply`).
"""
