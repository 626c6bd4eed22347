"""The error a policy raises where it cannot mean anything for a function (JAX-free)."""


class PolicyDoesNotApply(ValueError):
    """A policy that cannot mean anything for this function: names it lists that the function does
    not tag, or ``selective`` on a function without an attention core.

    A ``ValueError``; the message says what was looked for and what to use instead. The pytest
    plugin's ``remat_exact`` reports such a policy as skipped for that function.
    """
