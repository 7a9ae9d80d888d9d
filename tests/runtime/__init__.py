"""Specs of trainer.runtime: SIGTERM/SIGINT answered in every phase."""
