"""Device setup and the strategy factory.

Owns everything that decides *where* computation runs: virtual (logical) devices,
GPU memory growth and memory caps, the sizes of TF's thread pools, placement logging, and which
``tf.distribute.Strategy`` a run uses. :func:`configure_devices` must run before
TensorFlow initialises its runtime (before the first op or ``list_logical_devices``);
:func:`build_strategy` calls it.

Strategy names (``config.distribute.strategy``):

* ``auto``: TPU if one is attached; else Mirrored over all GPUs if there are more
  than one, or over the logical devices made by ``virtual_devices > 1``; else one device.
* ``default``: TensorFlow's default (no-op) strategy.
* ``one_device``: ``OneDeviceStrategy`` on ``devices[0]``, the first GPU, or the CPU.
* ``mirrored``: ``MirroredStrategy`` over ``devices``, all GPUs, or all logical CPUs.
* ``multi_worker``: ``MultiWorkerMirroredStrategy``; needs ``TF_CONFIG``.
* ``tpu``: ``TPUStrategy`` through ``tf_cluster.tpu.connect_tpu``.
* ``manual``: ``OneDeviceStrategy`` on the first of ``devices`` (variables, input,
  update); :mod:`trainer.distribution.data_parallel` splits every batch over ``devices`` by
  ``device_weights`` and combines the gradients itself.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import ml_collections
import tensorflow as tf
from absl import logging

from tf_cluster.ports import check_own_port
from tf_cluster.tf_config import TFConfigError, validate_tf_config
from tf_cluster.tpu import TPUConnectError, TPUNotFoundError, connect_tpu, tpu_attached
from trainer.config import ConfigError, check_batch_divisible
from trainer.data import BatchSizes
from trainer.distribution.host_collectives import is_chief, num_workers

__all__ = ["accelerator_devices", "build_strategy", "configure_devices", "configure_threads",
           "describe", "slow_float16_devices",
           "is_chief", "num_workers", "resolve_devices", "resolve_strategy_name",
           "tf_config_task_type"]


def _physical(kind: str) -> list:
    return tf.config.list_physical_devices(kind)


def _set_logical(device, configs: Sequence, what: str) -> None:
    current = tf.config.get_logical_device_configuration(device)
    if current is not None and len(current) == len(configs) and all(
        getattr(a, "memory_limit", None) == getattr(b, "memory_limit", None)
        for a, b in zip(current, configs)
    ):
        return  # already configured identically (e.g. a second Trainer in this process)
    try:
        tf.config.set_logical_device_configuration(device, list(configs))
    except RuntimeError as error:
        raise ConfigError(
            f"{what} must be set before TensorFlow initialises its runtime, and this "
            f"process already initialised it with another device layout ({error}). Set it "
            f"in a fresh process: pass it on the command line or build the Trainer before "
            f"running any TensorFlow op."
        ) from error


_POOLS = {
    "inter_op_threads": (tf.config.threading.get_inter_op_parallelism_threads,
                         tf.config.threading.set_inter_op_parallelism_threads),
    "intra_op_threads": (tf.config.threading.get_intra_op_parallelism_threads,
                         tf.config.threading.set_intra_op_parallelism_threads),
}


def configure_threads(dcfg: ml_collections.ConfigDict) -> None:
    """Applies ``distribute.{inter_op_threads, intra_op_threads}``: a size > 0 sizes
    TensorFlow's pool; 0 leaves it as it is (TF's own choice unless set earlier in the
    process). Before TensorFlow initialises its runtime (before any strategy): a
    process already running with another size is a ConfigError."""
    for field, (get, set_size) in _POOLS.items():
        wanted = int(dcfg[field])
        if wanted == 0 or get() == wanted:
            continue
        try:
            set_size(wanted)
        except RuntimeError as error:
            raise ConfigError(
                f"config.distribute.{field}={wanted} must be set before TensorFlow "
                f"initialises its runtime, and this process already runs with "
                f"{get() or 'its own choice'} ({error}). Set it in a fresh process: pass it "
                f"on the command line or build the Trainer before running any TensorFlow "
                f"op.") from error


def configure_devices(dcfg: ml_collections.ConfigDict) -> None:
    """Applies ``distribute.{virtual_devices, memory_limit_mb, memory_growth, log_placement}``.

    ``virtual_devices=N > 1`` splits the first GPU (if any, with ``memory_limit_mb``
    each) or else the CPU into N logical devices. ``memory_limit_mb`` alone caps every
    GPU at that size (one logical device each), so several jobs can share a GPU.
    ``memory_growth`` applies to every GPU not given a fixed layout.
    """
    gpus = _physical("GPU")
    limited = set()
    if dcfg.virtual_devices > 1:
        if gpus:
            if not dcfg.memory_limit_mb:
                raise ConfigError(
                    "config.distribute.virtual_devices on a GPU needs "
                    "config.distribute.memory_limit_mb (the memory of each slice), e.g. 2048."
                )
            conf = tf.config.LogicalDeviceConfiguration(memory_limit=dcfg.memory_limit_mb)
            _set_logical(gpus[0], [conf] * dcfg.virtual_devices, "distribute.virtual_devices")
            limited.add(gpus[0].name)
        else:
            conf = tf.config.LogicalDeviceConfiguration()
            _set_logical(_physical("CPU")[0], [conf] * dcfg.virtual_devices,
                         "distribute.virtual_devices")
    if dcfg.memory_limit_mb:
        for gpu in gpus:
            if gpu.name not in limited:
                conf = tf.config.LogicalDeviceConfiguration(memory_limit=dcfg.memory_limit_mb)
                _set_logical(gpu, [conf], "distribute.memory_limit_mb")
                limited.add(gpu.name)
    if dcfg.memory_growth:
        for gpu in gpus:
            if gpu.name in limited:
                logging.info("memory_growth not applied to %s: it has a fixed memory limit.",
                             gpu.name)
                continue
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except (RuntimeError, ValueError) as error:
                raise ConfigError(
                    f"config.distribute.memory_growth could not be applied to {gpu.name} "
                    f"({error}); it must be set before TensorFlow uses the GPU."
                ) from error
    if dcfg.log_placement:
        tf.debugging.set_log_device_placement(True)


def resolve_devices(dcfg: ml_collections.ConfigDict) -> list[str]:
    """The manual mode's devices, checked, as logical device names (``/device:GPU:1``).

    ``distribute.devices``, or else every logical GPU, or else every logical CPU (with
    ``distribute.virtual_devices=N``: the N logical CPUs). Call after
    ``distribute.configure_devices``. Raises ``ConfigError`` for a name that is not a
    device of this process, a device listed twice, or ``device_weights`` of another
    length.
    """
    available = {}
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        available[(spec.device_type, spec.device_index)] = device.name
    requested = list(dcfg.devices) or [
        d.name for d in (tf.config.list_logical_devices("GPU")
                         or tf.config.list_logical_devices("CPU"))]
    names: list[str] = []
    for name in requested:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"config.distribute.devices: {name!r} is not a device name "
                              f"such as '/gpu:0' or '/cpu:1' ({error}).") from error
        canonical = available.get((spec.device_type, spec.device_index))
        if canonical is None or spec.job not in (None, "localhost"):
            raise ConfigError(
                f"config.distribute.devices: {name!r} is not a device of this process, which "
                f"has {', '.join(available.values())}. Name local devices only; for "
                f"several CPU devices set distribute.virtual_devices=N.")
        if canonical in names:
            raise ConfigError(f"config.distribute.devices lists {canonical} twice; give "
                              f"each device once and raise its weight instead.")
        names.append(canonical)
    weights = dcfg.device_weights
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"config.distribute.device_weights has {len(weights)} weights for "
            f"{len(names)} devices ({', '.join(names)}); give one weight per device, or set "
            f"distribute.devices.")
    return names


def _cross_device_ops(name: str):
    return {
        "auto": None,
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
    }[name]


def _mirrored(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    devices = resolve_devices(dcfg) if dcfg.devices else []
    if not devices:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
    if dcfg.all_reduce == "ring":
        raise ConfigError(
            "config.distribute.all_reduce='ring' is a multi_worker option; for mirrored use "
            "'auto', 'nccl', 'hierarchical_copy' or 'reduction_to_one_device'."
        )
    ops_cls = _cross_device_ops(dcfg.all_reduce)
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops_cls() if ops_cls else None)


def _multi_worker(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise ConfigError(
            "config.distribute.strategy='multi_worker' needs the TF_CONFIG environment "
            "variable (cluster and task). Start the workers with "
            "`python -m launch.multiworker --workers N ...`, or set TF_CONFIG yourself."
        )
    try:
        tf_config = json.loads(raw)
        validate_tf_config(tf_config)
        check_own_port(tf_config)
    except json.JSONDecodeError as error:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {error}") from error
    except TFConfigError as error:
        raise ConfigError(str(error)) from error
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }.get(dcfg.all_reduce)
    if implementation is None:
        raise ConfigError(
            f"config.distribute.all_reduce={dcfg.all_reduce!r} is not a multi_worker option; "
            f"use 'auto', 'ring' or 'nccl'."
        )
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation, timeout_seconds=dcfg.collective_timeout_s or None
    )
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except RuntimeError as error:
        raise ConfigError(
            f"MultiWorkerMirroredStrategy could not start ({error}). It must be created "
            f"at program start, before any other TensorFlow op, with TF_CONFIG already "
            f"set in the environment."
        ) from error


def _tpu(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    try:
        resolver = connect_tpu(dcfg.tpu)
    except (TPUNotFoundError, TPUConnectError, ValueError) as error:
        raise ConfigError(f"config.distribute.strategy='tpu': {error}") from error
    return tf.distribute.TPUStrategy(resolver)


def _one_device(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    if dcfg.devices:
        device = resolve_devices(dcfg)[0]
    else:
        device = "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device)


def tf_config_task_type() -> str | None:
    """The task type TF_CONFIG gives this process (``"worker"``, ``"evaluator"``...);
    None when TF_CONFIG is unset or names no task (the strategy reports a broken one)."""
    try:
        task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task") or {}
        return task.get("type") if isinstance(task, dict) else None
    except (json.JSONDecodeError, AttributeError):
        return None


def resolve_strategy_name(dcfg: ml_collections.ConfigDict) -> str:
    """Turns ``auto`` into a concrete strategy name; other names pass through."""
    if dcfg.strategy != "auto":
        return dcfg.strategy
    if tpu_attached():
        return "tpu"
    if os.environ.get("TF_CONFIG"):
        return "multi_worker"
    if len(_physical("GPU")) > 1 or dcfg.virtual_devices > 1 or len(dcfg.devices) > 1:
        return "mirrored"
    return "one_device"


_STRATEGIES: dict[str, tf.distribute.Strategy] = {}
#: ``distribute`` fields read by the Trainer, not by the strategy it runs on.
NOT_STRATEGY_FIELDS = ("consistency_check", "sync_batch_norm", "device_weights",
                       "grad_compression", "grad_pack_bytes")


def build_strategy(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    """Configures devices and returns the strategy ``dcfg.strategy`` names.

    One strategy per distinct ``distribute`` config per process: a second Trainer with
    the same settings shares it. (Two Mirrored strategies over the same devices would
    allocate the same collective keys and clash at run time.) The fields that do not
    shape the strategy (:data:`NOT_STRATEGY_FIELDS`) are not part of the settings: two
    Trainers that differ only there share it.
    """
    key = json.dumps({k: v for k, v in dcfg.to_dict().items()
                      if k not in NOT_STRATEGY_FIELDS}, sort_keys=True, default=str)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = _build_strategy(dcfg)
    return _STRATEGIES[key]


def _build_strategy(dcfg: ml_collections.ConfigDict) -> tf.distribute.Strategy:
    configure_threads(dcfg)  # before anything touches the runtime
    name = resolve_strategy_name(dcfg)
    if (os.environ.get("TF_CONFIG") and name not in ("multi_worker", "tpu")
            and tf_config_task_type() != "evaluator"):  # the evaluator runs alone by design
        logging.warning(
            "TF_CONFIG is set but the strategy is %r: this process trains alone. Use "
            "--config.distribute.strategy=multi_worker to join the cluster.", name)
    if name == "multi_worker":
        # MultiWorkerMirroredStrategy must be the first thing that touches the runtime.
        strategy = _multi_worker(dcfg)
        configure_devices(dcfg)
        return strategy
    configure_devices(dcfg)
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "manual":  # trainer.distribution.data_parallel splits each batch over the devices itself
        return tf.distribute.OneDeviceStrategy(resolve_devices(dcfg)[0])
    return {"one_device": _one_device, "mirrored": _mirrored, "tpu": _tpu}[name](dcfg)


def accelerator_devices(strategy: tf.distribute.Strategy) -> list[str]:
    """This worker's non-CPU devices the strategy computes on, as ``"GPU:0"`` names.

    The default strategy has no device list of its own: it uses every local device.
    """
    try:
        names = list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy does not implement worker_devices
        names = [d.name for d in tf.config.list_logical_devices()]
    out = []
    for name in names:
        spec = tf.DeviceSpec.from_string(name)
        if spec.device_type and spec.device_type.upper() != "CPU":
            out.append(f"{spec.device_type}:{spec.device_index or 0}")
    return out


# GPUs below this compute capability have no tensor cores: float16 is no faster there.
FAST_FLOAT16_COMPUTE_CAPABILITY = (7, 0)


def slow_float16_devices(strategy: tf.distribute.Strategy) -> list[str]:
    """This worker's compute devices without fast float16 arithmetic, as names for a
    message: ``"CPU"`` when the strategy computes on the CPU (float16 is emulated there),
    each TPU (bfloat16 units, no float16 ones), each GPU of compute capability below
    :data:`FAST_FLOAT16_COMPUTE_CAPABILITY`. Empty when every device has fast float16."""
    accelerators = accelerator_devices(strategy)
    if not accelerators:
        return ["CPU"]
    slow = [name for name in accelerators if name.startswith("TPU")]
    if any(name.startswith("GPU") for name in accelerators):
        for index, gpu in enumerate(_physical("GPU")):
            capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
            if capability and tuple(capability) < FAST_FLOAT16_COMPUTE_CAPABILITY:
                slow.append(f"GPU:{index} (compute capability {capability[0]}.{capability[1]})")
    return slow


def describe(strategy: tf.distribute.Strategy) -> str:
    """A one-screen report of devices and the strategy, for the start of a run."""
    lines = ["Devices and strategy"]
    for kind in ("CPU", "GPU", "TPU"):
        physical = _physical(kind)
        if not physical:
            continue
        logical = tf.config.list_logical_devices(kind)
        growth = ""
        if kind == "GPU":
            growth = "  memory growth: " + ", ".join(
                str(tf.config.experimental.get_memory_growth(g)) for g in physical)
        lines.append(f"  {kind}: {len(physical)} physical, {len(logical)} logical "
                     f"({', '.join(d.name for d in logical)}){growth}")
    lines.append(f"  strategy: {type(strategy).__name__}, replicas in sync: "
                 f"{strategy.num_replicas_in_sync}, workers: {num_workers(strategy)}")
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is not None and num_workers(strategy) > 1:
        lines.append(f"  this task: {resolver.task_type}:{resolver.task_id} "
                     f"(chief: {is_chief(strategy)})")
    pools = [f"{field.split('_op')[0]}-op {get() or 'TF default'}"
             for field, (get, _) in _POOLS.items()]
    lines.append(f"  thread pools: {', '.join(pools)}")
    lines.append(f"  placement logging: {tf.debugging.get_log_device_placement()}")
    return "\n".join(lines)


def batch_sizes(field: str, global_size: int, strategy: tf.distribute.Strategy) -> BatchSizes:
    """``global_size`` split over ``strategy``'s replicas in sync; raises ConfigError
    naming ``field`` and the fix when they do not divide it (before any step)."""
    replicas = strategy.num_replicas_in_sync
    check_batch_divisible(field, global_size, replicas)
    return BatchSizes(global_size, replicas)
