"""What does a feature or a usage pattern cost, against the same run without it?

Grad-norm logging and the EMA, the telemetry, the replica-consistency check, keyed
random draws, many Trainers in one process, and a hyperparameter sweep (its pruner,
its own cost).
"""
