"""When things happen: the loop driver behind ``fit()`` / ``evaluate()`` and its parts.

* :mod:`trainer.loop.driver` — the driver: loop cadence, callbacks, stop and rollback.
* :mod:`trainer.loop.context` — the run context the services see (the one
  implementation of :class:`trainer.run_context.RunContext`).
* :mod:`trainer.loop.compiled_loops` — the in-graph ``tf.function`` loops, and when the
  trainable variables change (the step is traced again).
* :mod:`trainer.loop.eval_pass` — an eval pass in calls of growing length.
* :mod:`trainer.loop.plan` — the execution plan, measured on the run.
* :mod:`trainer.loop.metric_readout` — the metrics read and reset from the host.

Nothing here imports a service (checkpoint, telemetry, services, doctor): they see the
run through the context.
"""

__all__ = ["compiled_loops", "context", "driver", "eval_pass", "metric_readout", "plan"]
