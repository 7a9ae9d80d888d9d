"""A user's mistake becomes one line: checks of hooks, inputs and buckets.

* :mod:`trainer.checks.hooks` — what each user hook returns, checked at its first call
  (one ``Hook error`` line).
* :mod:`trainer.checks.held_layers` — a trainable Keras layer the Trainer holds beside
  its model (after ``build_model`` and after the step's trace).
* :mod:`trainer.checks.inputs` — the data against the model on the first batch, and the
  runtime errors the data causes.
* :mod:`trainer.checks.bucket` — is a ``gs://`` bucket there and ours (no TensorFlow).

Importing this package loads none of them: ``trainer.cli`` uses the bucket check
before TensorFlow is imported.
"""

__all__ = ["bucket", "held_layers", "hooks", "inputs"]
