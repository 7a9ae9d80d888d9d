"""Specs of trainer.services: evaluation, early stopping, non-finite handling (and EMA)."""
