"""The ground every part stands on: signals, fast exit, waits, tracing, Keras compatibility,
the bucket client.

* :mod:`trainer.runtime.signals` — SIGTERM/SIGINT answered in every phase.
* :mod:`trainer.runtime.fast_exit` — ending a finished process quickly.
* :mod:`trainer.runtime.waiting` — a wait that lasts says what it waits for.
* :mod:`trainer.runtime.tracing` — how code meets ``tf.function`` tracing (AutoGraph
  for user hooks only, per-object functions).
* :mod:`trainer.runtime.seeds` — the seeds the dataset hooks see, the same at every call.
* :mod:`trainer.runtime.keras_compat` — the only module that touches Keras-private code.
* :mod:`trainer.runtime.pinned_draws` — TensorFlow's stateless draws as Keras' random
  modules see them (philox; a replica's rows of one global draw).
* :mod:`trainer.runtime.gcs` — the process's Google Cloud Storage client and its one
  retry policy, for every request to a bucket.
* :mod:`trainer.runtime.studies` — an Optuna storage opened from a ``--storage`` URL.

Importing this package loads none of them: the command lines use ``signals`` and
``fast_exit`` before TensorFlow is imported.
"""

__all__ = ["fast_exit", "gcs", "keras_compat", "pinned_draws", "seeds", "signals", "studies",
           "tracing", "waiting"]
