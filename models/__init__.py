"""Example Trainer subclasses; each has a config in ``models/configs/``."""
