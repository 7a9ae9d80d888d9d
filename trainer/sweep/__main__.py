"""``python -m trainer.sweep``: hyperparameter sweeps (:mod:`trainer.sweep.cli`)."""

from trainer.sweep.cli import run

run()
