"""Specs of python -m trainer.sweep: the space, bad input in one line, real sweeps of the
digits demo (two trials at a time, a trial preempted by SIGTERM, a sweep killed)."""
