"""Training services that act between loops: each one a :class:`trainer.run_context.Service`.

* :mod:`trainer.services.evaluation` — periodic evaluation during ``fit()``.
* :mod:`trainer.services.early_stopping` — ``train.early_stopping``.
* :mod:`trainer.services.pruning` — ``sweep.pruner``: a sweep's trial reports its
  evaluations to the study and stops when pruned.
* :mod:`trainer.services.nonfinite` — ``train.on_nonfinite``: stop or roll back on NaN.
* :mod:`trainer.services.history` — what ``fit()`` returns, the same keys every time.
* :mod:`trainer.services.consistency` — ``distribute.consistency_check``: do the
  replicas' copies agree.
"""

__all__ = ["consistency", "early_stopping", "evaluation", "history", "nonfinite", "pruning"]
