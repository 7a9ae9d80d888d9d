"""Specs of trainer.checkpoint: what is saved, where, when, and resuming after a kill."""
