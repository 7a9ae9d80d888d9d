"""The TensorFlow side of the command lines: fit, and evaluation apart from training.

* :mod:`trainer.commands.fit` — ``python -m trainer.main --mode=train``: build the
  Trainer, fit, print the result line (``trainer.main`` loads it once flags, config and
  workdir are checked).
* :mod:`trainer.commands.continuous_eval` — ``--mode=eval`` / ``--mode=continuous_eval``:
  evaluate the workdir's checkpoints, never train or save.
"""

__all__ = ["continuous_eval", "fit"]
