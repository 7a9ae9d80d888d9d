"""Specs of trainer.loop: the driver's cadence, eval passes and the execution plan."""
