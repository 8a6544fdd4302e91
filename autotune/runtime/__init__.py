"""The runtime: execute a Plan for real on torch.distributed (model, mesh, TP, PP, DP, CP/HP, trials).

Importing this package starts nothing; ``trial.run_trial`` launches worker processes.
"""
