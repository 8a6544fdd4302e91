"""Search spaces, one module per space, chosen by name (``autotune search --space NAME``).

A space module defines ``NAME`` and ``space(ctx) -> Space`` (see ``search_spaces.base``): fixed
Optuna distributions per parameter name, a pure ``build(params) -> Plan | Infeasible``, the
baselines to enqueue first, the grid for ``--sampler grid`` and one-step neighbours for the polish.
``autotune.search.load_space(name)`` finds them.
"""
