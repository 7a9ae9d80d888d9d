"""The configuration schema: the default ``ConfigDict`` every experiment extends.

An experiment file defines ``get_config()`` that starts from :func:`get_config`, sets
``config.trainer = "package.module:ClassName"`` and overrides what it needs. Any field
can be overridden on the command line: ``--config.train.steps=500``.

Sections ``model`` and ``data`` are free-form: a ``Trainer`` subclass keeps its own
settings there. Every other section has a fixed set of keys, and :func:`validate`
rejects an unknown key (a typo such as ``train.step``) with a suggestion; ``sweep``'s
values are checked by ``python -m trainer.sweep`` (a run reads them as a trial with a
pruner: :mod:`trainer.services.pruning`). The whole schema: docs/configuration.md."""

from __future__ import annotations

import importlib
import importlib.util

import ml_collections

from trainer.config_checkpoint import checkpoint_section, validate_checkpoint
from trainer.errors import ConfigError  # raised here; importers take it from trainer.config
from trainer.errors import check_choice, check_known_fields, check_positive
from trainer.errors import require, suggest

STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu", "manual")
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "lamb", "lion")
SCHEDULES = ("constant", "warmup_constant", "cosine", "warmup_cosine", "linear")
CONSISTENCY_CHECKS = ("auto", "every_loop", "off")
ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device", "ring")
GRAD_COMPRESSION = ("none", "bf16", "fp16")  # distribute.grad_compression
RANDOM_DRAWS = ("per_replica", "global")  # distribute.random_draws
FREE_FORM_SECTIONS = ("model", "data")
LOGGERS = ("jsonl", "tensorboard", "mlflow")  # telemetry.loggers (chief only)


def get_config() -> ml_collections.ConfigDict:
    """Returns the default configuration (the full schema with its defaults)."""
    config = ml_collections.ConfigDict()
    config.trainer = ""  # "package.module:ClassName" of the Trainer subclass main.py builds
    config.seed = 0

    config.train = ml_collections.ConfigDict(
        dict(
            global_batch_size=64,  # examples per step over ALL replicas and workers
            steps=1000,  # total optimizer steps (global batches) of the run
            steps_per_loop=50,  # steps run inside one tf.function call (in-graph loop)
            log_every_steps=100,  # logging window, rounded up to whole loops
            # A NaN/inf all-reduced gradient: "skip" the update on every replica, "stop",
            # "rollback" (trainer.services.nonfinite); "auto": skip under mixed_float16.
            on_nonfinite="auto",
            rollback_after=1,  # "rollback": after this many non-finite steps in a row
            loss_upper_bound=0.0,  # "rollback" also when a loop's loss exceeds it; 0: off
            max_rollbacks=3,  # then stop with an error
            deterministic=True,  # tf.data deterministic order (exact resume needs it)
            # Stop when eval/METRIC improved by <= min_delta `patience` times in a row; "": off.
            early_stopping=ml_collections.ConfigDict(
                dict(metric="", mode="min", patience=0, min_delta=0.0)),
        )
    )
    config.eval = ml_collections.ConfigDict(
        dict(
            global_batch_size=0,  # 0: same as train.global_batch_size
            every_steps=0,  # 0: evaluate only at the end of fit()
            steps=-1,  # -1: a full pass over the eval dataset
        )
    )
    config.optimizer = ml_collections.ConfigDict(
        dict(
            name="adam",
            learning_rate=1e-3,
            schedule="constant",
            warmup_steps=0,
            decay_steps=0,  # 0: train.steps
            min_learning_rate=0.0,
            momentum=0.9,  # sgd / rmsprop only
            weight_decay=0.0,
            clipnorm=0.0,  # > 0: clip by GLOBAL norm of the all-reduced gradients
            ema_decay=0.0,  # > 0: an EMA of the weights for evaluate(), best, export()
            ema_every_steps=1,  # N > 1: move the EMA every N updates by ema_decay**N
            lr_scaling="none",  # "none" | "linear" (against reference_batch_size)
            reference_batch_size=0,
        )
    )
    config.precision = ml_collections.ConfigDict(
        dict(policy="float32", initial_loss_scale=2.0**15, growth_interval=2000)
    )
    config.distribute = ml_collections.ConfigDict(
        dict(
            strategy="auto",
            devices=(),  # explicit device names, e.g. ("/gpu:0", "/gpu:1")
            virtual_devices=0,  # > 1: split the first physical device into N logical ones
            memory_growth=False,
            log_placement=False,
            memory_limit_mb=0,  # > 0: cap this process's memory on each GPU
            # TF's thread pools, sized before its runtime starts (trainer.doctor measures).
            inter_op_threads=0, intra_op_threads=0,
            tpu="",  # TPU name or grpc:// address; "" = local / from the environment
            all_reduce="auto",
            collective_timeout_s=0,  # > 0: multi-worker collectives fail after this
            grad_pack_bytes=0,  # > 0: gradients all-reduced in packs of ~N bytes, last first
            grad_compression="none",  # "bf16" | "fp16": dense gradients all-reduced in 16 bits
            device_weights=(),  # manual: batch share per device (default: equal)
            # Do all copies of the variables agree? "auto": after the first loop of each
            # fit() and before each checkpoint; "every_loop"; "off".
            consistency_check="auto",
            sync_batch_norm=False,  # True: BatchNormalization by the global batch's statistics
            random_draws="per_replica",  # "global": N replicas draw what 1 draws (random_streams)
        )
    )
    config.perf = ml_collections.ConfigDict(
        dict(
            jit_compile=False,
            jit_compile_step=False,  # True: XLA compiles the whole replica step (plan "step")
            grad_accum_steps=1,
            recompute=False,
            sparse_reduce="auto",  # IndexedSlices across replicas: "auto" | "dense" | "gather"
            # "auto": time candidate plans on the first steps (trainer.loop.plan); "fixed".
            plan="auto",
            plan_min_run_s=30.0,  # runs estimated shorter are not measured
            plan_trial_s=0.2,  # about this long per candidate and round
            plan_rounds=5,
            plan_cache="",  # "": $XDG_CACHE_HOME/tf-trainer/plans; a directory; "off"
        )
    )
    config.checkpoint = checkpoint_section()  # trainer.config_checkpoint
    config.telemetry = ml_collections.ConfigDict(
        dict(
            profile_steps="",  # "200:210" or "200:210,500:505": profiler windows
            progress="auto",  # "auto" | "bar" | "lines" | "off"
            probe_every_windows=20,  # input-wait probe cadence in logging windows; 0: off
            probe_batches=5,  # batches each input-wait probe times
            # periodic and slow-window probes skip past this fraction of wall time; 0: no cap
            probe_budget=0.005,
            alert_drop=0.3,  # regression alert: examples/s this far below the running median
            alert_windows=3,  # ... for this many consecutive logging windows
            grad_norm=True,  # train/grad_norm: global norm of the reduced gradients
            # ... computed every N-th optimizer update (at least once per logging window),
            # every update when optimizer.clipnorm > 0 (clipping computes it anyway)
            grad_norm_every=10,
            # "jsonl" (workdir/metrics.jsonl), "tensorboard" (workdir/train, workdir/eval),
            # "mlflow" (MLFLOW_TRACKING_URI; pip install 'tf-trainer[mlflow]').
            loggers=("jsonl", "tensorboard"),
            peak_tflops=0.0,  # > 0: one device's peak TFLOPS for train/mfu, hfu (0: table)
        )
    )
    config.sweep = ml_collections.ConfigDict(dict(  # trainer.sweep's; trial..study: its trials'
        space=(), metric="", direction="maximize", pruner="none", pruner_startup_trials=5,
        pruner_warmup_steps=0, seed=0, max_retries=1, trial=-1, storage="", study=""))
    config.model = ml_collections.ConfigDict()
    # Free-form, plus "service": a tf.data service dispatcher "host:port" ("" = off) that
    # the training input goes through (trainer.data; needs train.deterministic=False).
    config.data = ml_collections.ConfigDict(dict(service=""))
    return config


def _check_known_keys(config: ml_collections.ConfigDict) -> None:
    schema = get_config()
    for key in config.keys():
        if key not in schema:
            raise ConfigError(
                f"config.{key} is not a field of the schema.{suggest(key, schema.keys())} "
                f"Keep model- or data-specific settings under config.model or config.data."
            )
        if key in FREE_FORM_SECTIONS or not isinstance(schema[key], ml_collections.ConfigDict):
            continue
        section = config[key]
        if not isinstance(section, (ml_collections.ConfigDict, dict)):
            raise ConfigError(f"config.{key} must be a section (ConfigDict), got {section!r}.")
        check_known_fields(f"config.{key}", section, schema[key])


def _check_device_weights(dcfg: ml_collections.ConfigDict) -> None:
    """``distribute.device_weights``: non-negative numbers, one per device, manual only."""
    weights = dcfg.device_weights
    if not weights:
        return
    field = "config.distribute.device_weights"
    if dcfg.strategy != "manual":
        raise ConfigError(f"{field} is only used by distribute.strategy='manual' (it is "
                          f"{dcfg.strategy!r}); set the strategy to 'manual' or clear it.")
    if not isinstance(weights, (list, tuple)) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(f"{field}={weights!r} must be a list of numbers, e.g. (1, 2, 1).")
    negative = [w for w in weights if w < 0]
    if negative or not sum(weights) > 0:
        raise ConfigError(f"{field}={tuple(weights)!r}: weights must be >= 0 with a positive "
                          f"sum (each is a device's share of the batch), e.g. (1, 2, 1).")
    if dcfg.devices and len(weights) != len(dcfg.devices):
        raise ConfigError(f"{field} has {len(weights)} weights for {len(dcfg.devices)} "
                          f"distribute.devices {tuple(dcfg.devices)!r}; give one per device.")


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks the config against the schema; raises ConfigError naming the field.

    Checks that need the strategy (batch divisibility by the replica count) are in
    :func:`check_batch_divisible`, called once the strategy exists.
    """
    _check_known_keys(config)
    check_positive("train.global_batch_size", config.train.global_batch_size)
    check_positive("train.steps", config.train.steps)
    check_positive("train.steps_per_loop", config.train.steps_per_loop)
    check_positive("train.log_every_steps", config.train.log_every_steps)
    check_choice("train.on_nonfinite", config.train.on_nonfinite,
                  ("auto", "skip", "stop", "rollback"))
    check_positive("train.rollback_after", config.train.rollback_after)
    check_positive("train.max_rollbacks", config.train.max_rollbacks, allow_zero=True)
    bound = config.train.loss_upper_bound
    require("train.loss_upper_bound", bound, bound >= 0, ">= 0 (0: off)")
    _check_early_stopping(config.train.early_stopping)
    check_positive("eval.global_batch_size", config.eval.global_batch_size, allow_zero=True)
    check_positive("eval.every_steps", config.eval.every_steps, allow_zero=True)
    steps = config.eval.steps
    require("eval.steps", steps, isinstance(steps, int) and (steps == -1 or steps > 0),
             "-1 (full pass) or > 0")
    check_choice("optimizer.name", config.optimizer.name, OPTIMIZERS)
    check_choice("optimizer.schedule", config.optimizer.schedule, SCHEDULES)
    check_choice("optimizer.lr_scaling", config.optimizer.lr_scaling, ("none", "linear"))
    opt = config.optimizer
    require("optimizer.learning_rate", opt.learning_rate, opt.learning_rate >= 0, ">= 0")
    require("optimizer.ema_decay", opt.ema_decay, 0 <= opt.ema_decay < 1,
             "in [0, 1) (0: off; e.g. 0.999)")
    require("optimizer.clipnorm", opt.clipnorm, opt.clipnorm >= 0, ">= 0")
    check_positive("optimizer.ema_every_steps", opt.ema_every_steps)
    check_positive("optimizer.warmup_steps", config.optimizer.warmup_steps, allow_zero=True)
    check_positive("optimizer.decay_steps", config.optimizer.decay_steps, allow_zero=True)
    check_choice("precision.policy", config.precision.policy, POLICIES)
    scale = config.precision.initial_loss_scale
    require("precision.initial_loss_scale", scale, scale > 0, "> 0")
    check_positive("precision.growth_interval", config.precision.growth_interval)
    for field, choices in (("strategy", STRATEGIES), ("all_reduce", ALL_REDUCE),
                           ("consistency_check", CONSISTENCY_CHECKS),
                           ("grad_compression", GRAD_COMPRESSION), ("random_draws", RANDOM_DRAWS)):
        check_choice(f"distribute.{field}", config.distribute[field], choices)
    _check_device_weights(config.distribute)
    for field in ("virtual_devices", "memory_limit_mb", "grad_pack_bytes", "inter_op_threads",
                  "intra_op_threads"):
        check_positive(f"distribute.{field}", config.distribute[field], allow_zero=True)
    _check_fp16_compression(config)
    _check_perf(config)
    validate_checkpoint(config)
    tel = config.telemetry
    check_choice("telemetry.progress", tel.progress, ("auto", "bar", "lines", "off"))
    parse_profile_steps(tel.profile_steps)
    check_positive("telemetry.probe_every_windows", tel.probe_every_windows, allow_zero=True)
    check_positive("telemetry.probe_batches", tel.probe_batches)
    require("telemetry.probe_budget", tel.probe_budget, 0 <= tel.probe_budget < 1,
             "in [0, 1) (e.g. 0.005; 0: no cap)")
    check_positive("telemetry.grad_norm_every", config.telemetry.grad_norm_every)
    check_positive("telemetry.alert_windows", config.telemetry.alert_windows)
    _check_loggers(config.telemetry.loggers)
    _check_data_service(config)
    require("telemetry.peak_tflops", tel.peak_tflops, tel.peak_tflops >= 0,
             ">= 0 (one device's peak TFLOPS; 0: from trainer.telemetry.flops's table)")
    require("telemetry.alert_drop", tel.alert_drop, 0 < tel.alert_drop < 1,
             "a fraction in (0, 1), e.g. 0.3 for a 30% drop")


def _check_fp16_compression(config: ml_collections.ConfigDict) -> None:
    """``distribute.grad_compression="fp16"`` needs dynamic loss scaling (mixed_float16)."""
    policy = config.precision.policy
    if config.distribute.grad_compression == "fp16" and policy != "mixed_float16":
        raise ConfigError(
            f"config.distribute.grad_compression='fp16' needs precision.policy='mixed_float16' "
            f"(it is {policy!r}): float16 spans only ~6e-8 to 65504, so a summed gradient can "
            f"overflow to inf or round to 0, and only dynamic loss scaling skips such a step and "
            f"lowers its scale. Use --config.distribute.grad_compression=bf16 (float32's "
            f"range), or --config.precision.policy=mixed_float16.")


def _check_perf(config: ml_collections.ConfigDict) -> None:
    """``perf.*``, and the steps a gradient accumulation window must divide."""
    perf = config.perf
    require("perf.plan", perf.plan, perf.plan in ("auto", "fixed"), "'auto' or 'fixed'")
    check_choice("perf.sparse_reduce", perf.sparse_reduce, ("auto", "dense", "gather"))
    require("perf.plan_min_run_s", perf.plan_min_run_s, perf.plan_min_run_s >= 0, ">= 0")
    require("perf.plan_trial_s", perf.plan_trial_s, perf.plan_trial_s > 0, "> 0")
    check_positive("perf.plan_rounds", perf.plan_rounds)
    check_positive("perf.grad_accum_steps", perf.grad_accum_steps)
    check_positive("checkpoint.every_steps", config.checkpoint.every_steps, allow_zero=True)
    accum = perf.grad_accum_steps
    for section, name in (("train", "steps"), ("checkpoint", "every_steps")):
        if config[section][name] % accum:
            raise ConfigError(
                f"config.{section}.{name}={config[section][name]} is not a multiple of "
                f"perf.grad_accum_steps={accum}: steps count micro-batches and an optimizer "
                f"update happens every {accum}; use a multiple of {accum}.")


def _check_early_stopping(es: ml_collections.ConfigDict) -> None:
    if es.metric and not (isinstance(es.metric, str) and es.metric.startswith("eval/")
                          and len(es.metric) > 5):
        raise ConfigError(f"config.train.early_stopping.metric={es.metric!r} must be '' (off) "
                          f"or an evaluation value 'eval/NAME', e.g. 'eval/loss'.")
    check_choice("train.early_stopping.mode", es.mode, ("min", "max"))
    check_positive("train.early_stopping.patience", es.patience, allow_zero=True)
    require("train.early_stopping.min_delta", es.min_delta, es.min_delta >= 0, ">= 0")


def _check_data_service(config: ml_collections.ConfigDict) -> None:
    """``data.service`` needs ``train.deterministic=False`` (see :mod:`trainer.data`)."""
    service = config.data.get("service", "")
    if service and config.train.deterministic:
        raise ConfigError(
            f"config.data.service={service!r} with train.deterministic=True: the tf.data "
            f"service delivers batches in an order that depends on its workers' timing, so "
            f"the run can be neither reproduced nor resumed at the exact batch. Set "
            f"--config.train.deterministic=False to accept that, or drop the service.")


def _check_loggers(loggers) -> None:
    """``telemetry.loggers``: a list of known names; ``"mlflow"`` needs mlflow installed."""
    field = "config.telemetry.loggers"
    if isinstance(loggers, str) or not isinstance(loggers, (list, tuple)):
        raise ConfigError(f"{field}={loggers!r} must be a list of names from "
                          f"{', '.join(map(repr, LOGGERS))}, e.g. ('jsonl', 'tensorboard').")
    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"{field}: {name!r} is not a logger; the loggers are "
                              f"{', '.join(map(repr, LOGGERS))}.{suggest(str(name), LOGGERS)}")
    if "mlflow" in loggers and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"{field} includes 'mlflow' but mlflow is not installed: "
                          f"pip install 'tf-trainer[mlflow]' (or drop 'mlflow').")


def parse_profile_steps(spec: str) -> list[tuple[int, int]]:
    """Parses ``telemetry.profile_steps``: ``"200:210"`` or ``"200:210,500:505"``.

    ``"a:b"`` is the window of steps that take the global step from ``a`` to ``b``
    (the ``a+1``-th to the ``b``-th step, ``b - a`` steps). Windows must be sorted and
    must not overlap. Returns ``[(a, b), ...]`` (empty for ``""``).
    """
    if not isinstance(spec, str):
        raise ConfigError(f"config.telemetry.profile_steps={spec!r} must be a string such as "
                          f"'200:210' or '200:210,500:505'.")
    windows: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            start, stop = (int(x) for x in part.split(":"))
        except ValueError:
            raise ConfigError(
                f"config.telemetry.profile_steps: {part!r} is not 'START:STOP' with integer "
                f"steps, e.g. '200:210'.") from None
        if not 0 <= start < stop:
            raise ConfigError(f"config.telemetry.profile_steps: window {part!r} needs "
                              f"0 <= START < STOP.")
        if windows and start < windows[-1][1]:
            raise ConfigError(f"config.telemetry.profile_steps: window {part!r} overlaps or "
                              f"precedes the previous one; list windows in increasing order.")
        windows.append((start, stop))
    return windows


def check_batches_divisible(config: ml_collections.ConfigDict, num_replicas: int) -> None:
    """Raises ConfigError unless ``train.global_batch_size`` and ``eval.global_batch_size``
    (when set; 0 means the train batch) divide over ``num_replicas`` replicas."""
    check_batch_divisible("train.global_batch_size", config.train.global_batch_size, num_replicas)
    if config.eval.global_batch_size:
        check_batch_divisible("eval.global_batch_size", config.eval.global_batch_size,
                              num_replicas)


def check_batch_divisible(field: str, global_batch_size: int, num_replicas: int) -> int:
    """Returns the per-replica batch size, or raises naming ``field`` and the fix."""
    if global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        raise ConfigError(
            f"config.{field}={global_batch_size} is not divisible by {num_replicas} replicas; "
            f"use a multiple of {num_replicas} (e.g. {lower or num_replicas} or "
            f"{lower + num_replicas}), or run on a number of replicas (workers x devices "
            f"per worker) that divides {global_batch_size}."
        )
    return global_batch_size // num_replicas
