"""What one step computes: the default steps and the gradient path behind them.

* :mod:`trainer.step.default_steps` — the default ``train_step`` / ``eval_step``.
* :mod:`trainer.step.gradients` — the gradient path: global-batch averaging, loss
  scaling, accumulation, one all-reduce, clipping, the finiteness check, the apply.
* :mod:`trainer.step.sparse_gradients` — ``IndexedSlices`` gradients across replicas.
* :mod:`trainer.step.update_context` — where an update may branch (replica context).
* :mod:`trainer.step.grad_norm` — ``train/grad_norm``.
* :mod:`trainer.step.ema` — the weights' exponential moving average.
* :mod:`trainer.step.replica_state` — the state a forward pass updates, equal on every
  replica.
* :mod:`trainer.step.owned_variables` — the trainable variables a Trainer holds itself.
* :mod:`trainer.step.random_streams` — random draws keyed per step and replica; the
  random generators' states a checkpoint holds.
"""

__all__ = ["default_steps", "ema", "grad_norm", "gradients", "owned_variables",
           "random_streams", "replica_state", "sparse_gradients", "update_context"]
