"""Show a study (docs/contracts.md, "Study"): ``terminal`` (rich, live with --watch), ``report``
(one self-contained HTML file with plotly inlined), ``serve`` (optuna-dashboard on 127.0.0.1).
``data`` reads the study into rows that all three share; ``charts`` and ``timeline`` feed the report."""
