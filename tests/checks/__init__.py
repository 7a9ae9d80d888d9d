"""Specs of trainer.checks: a user's mistake in a hook, the data or a bucket is one line."""
