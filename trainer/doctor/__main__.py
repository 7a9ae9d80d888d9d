"""``python -m trainer.doctor``: the performance doctor's command line."""

from trainer.doctor.cli import run

run()
