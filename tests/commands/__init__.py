"""Specs of trainer.commands: evaluation apart from training (--mode=eval, continuous_eval)."""
