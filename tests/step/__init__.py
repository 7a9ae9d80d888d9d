"""Specs of trainer.step: what one step computes (the weights' moving average, XLA on
the step)."""
