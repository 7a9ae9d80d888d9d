"""The ``checkpoint`` section of the configuration schema: its defaults and its checks.

:func:`trainer.config.get_config` takes the section from :func:`checkpoint_section` and
:func:`trainer.config.validate` checks it with :func:`validate_checkpoint` (unknown keys
are refused there, as in every fixed section). The saves themselves:
:mod:`trainer.checkpoint`; the whole schema: docs/configuration.md.
"""

from __future__ import annotations

import ml_collections

from trainer.errors import ConfigError, check_choice, check_positive, check_seconds


def checkpoint_section() -> ml_collections.ConfigDict:
    """The defaults of ``config.checkpoint``."""
    return ml_collections.ConfigDict(
        dict(
            every_steps=0,  # 0: only at the end of fit() (and on preemption)
            max_to_keep=3,
            best_metric="",  # e.g. "eval/accuracy": keep the best N as well
            best_mode="max",  # "max" | "min"
            async_save=True,
            fast_io=False,  # True: O_DIRECT .npy files (trainer.checkpoint.storage.array_files)
            # Multi-worker: each task waits this long for the chief's file (unshared: error).
            shared_workdir_timeout_s=30.0,
            # One run per workdir (trainer.checkpoint.guards.lease): a silent holder's lease is
            # taken over after this long (a dead pid on this host at once). 0: off.
            lease_s=30.0,
            preemption_grace_s=30.0,  # after SIGTERM: records, a bucket's save, given up
            staging_dir="",  # gs:// workdir: steps staged here before upload ("": $TMPDIR)
            # Every worker's own copy of the state every N steps on its local disk (keep 2,
            # never uploaded; trainer.checkpoint.storage.local_tier). 0: off.
            local_every_steps=0,
            # ... in this directory ("": $TMPDIR/tf-trainer-local/<workdir key>/task-<i>).
            local_dir="",
        )
    )


def validate_checkpoint(config: ml_collections.ConfigDict) -> None:
    """Checks ``config.checkpoint``'s values (not ``every_steps``' multiple of the
    accumulation window: :func:`trainer.config.validate` checks it with ``perf``)."""
    cp = config.checkpoint
    check_positive("checkpoint.max_to_keep", cp.max_to_keep)
    check_seconds("checkpoint.preemption_grace_s", cp.preemption_grace_s)
    check_seconds("checkpoint.shared_workdir_timeout_s", cp.shared_workdir_timeout_s,
                  "the shared-workdir check")
    check_seconds("checkpoint.lease_s", cp.lease_s, "the workdir lease")
    check_choice("checkpoint.best_mode", cp.best_mode, ("max", "min"))
    check_positive("checkpoint.local_every_steps", cp.local_every_steps, allow_zero=True)
    accum = config.perf.grad_accum_steps
    if cp.local_every_steps % accum:
        raise ConfigError(
            f"config.checkpoint.local_every_steps={cp.local_every_steps} is not a multiple of "
            f"perf.grad_accum_steps={accum}: a step inside an accumulation window holds "
            f"partial sums; use a multiple of {accum}.")
    best = cp.best_metric
    if best and not (isinstance(best, str) and best.partition("/")[0] in ("train", "eval")
                     and best.partition("/")[2]):
        raise ConfigError(f"config.checkpoint.best_metric={best!r} must be '' or name a value "
                          f"fit() reports: 'eval/NAME' or 'train/NAME', e.g. 'eval/accuracy'.")
