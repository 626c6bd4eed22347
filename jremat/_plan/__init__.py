"""Planning: the budget planner's per-layer and per-name choices (:mod:`.planner`) and the fit
search for the policy and batch that train fastest in a budget (:mod:`.fit`, :mod:`.probe`,
:mod:`.time_model`, :mod:`.fit_types`).

Imports: every room below it (up to :mod:`jremat._explain`).
"""
