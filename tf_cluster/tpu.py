"""Finding and connecting a TPU.

Detection (:func:`resolve_tpu`), for ``tpu=""``, in this order:

1. ``COLAB_TPU_ADDR`` (Colab's legacy TPU runtime) → ``grpc://ADDR``;
2. ``TPU_NAME`` (a named Cloud TPU node);
3. a local TPU device (``/dev/accel*``, ``/dev/vfio/N``) or ``TPU_ACCELERATOR_TYPE``
   (a TPU VM, including Colab's current TPU runtime) → ``"local"``;
4. nothing → :class:`TPUNotFoundError` at once, without importing TensorFlow.

:func:`connect_tpu` builds the ``TPUClusterResolver``, connects (a no-op for
``"local"``) and initialises the TPU system in a daemon thread and waits at most
``timeout_s``: a connect to a dead address otherwise blocks forever. Only the import of
this module is TensorFlow-free: :func:`connect_tpu` imports it. ``python -m launch.tpu``
is the command line on top of it.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any, Mapping

from tf_cluster.tf_config import TFConfigError, parse_address

_NO_TPU_HINT = ("use --config.distribute.strategy=auto or mirrored to train without one, "
                "or pass --tpu NAME / grpc://HOST:PORT")


class TPUNotFoundError(RuntimeError):
    """No TPU is attached or named; the message lists what was checked."""


class TPUConnectError(RuntimeError):
    """Connecting to or initialising the TPU failed or did not finish in time."""


def local_tpu_devices(dev_dir: str = "/dev") -> list[str]:
    """Paths of TPU device files on this host: ``accelN`` (v2-v4) and ``vfio/N`` (v5+)."""
    accel = glob.glob(os.path.join(dev_dir, "accel[0-9]*"))
    vfio = [p for p in glob.glob(os.path.join(dev_dir, "vfio", "*"))
            if os.path.basename(p).isdigit()]
    return sorted(accel) + sorted(vfio)


def tpu_attached(environ: Mapping[str, str] | None = None, dev_dir: str = "/dev") -> bool:
    """True if a TPU is named in the environment or a TPU device is on this host.

    Cheap and safe: reads environment variables and lists ``dev_dir``; never imports
    TensorFlow and never touches the network.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(k) for k in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE")):
        return True
    return bool(local_tpu_devices(dev_dir))


def resolve_tpu(tpu: str = "", environ: Mapping[str, str] | None = None,
                dev_dir: str = "/dev") -> str:
    """Returns the ``TPUClusterResolver`` argument for ``tpu`` (see the module docstring).

    ``tpu`` is ``""`` (detect), ``"local"``, a Cloud TPU name or ``grpc://host:port``.

    Raises:
      TPUNotFoundError: nothing is found, or ``"local"`` on a host without a TPU device.
      ValueError: a ``grpc://`` address that is not ``host:port``.
    """
    environ = os.environ if environ is None else environ
    tpu = (tpu or "").strip()
    if tpu == "local":
        if not local_tpu_devices(dev_dir) and not environ.get("TPU_ACCELERATOR_TYPE"):
            raise TPUNotFoundError(
                f"no TPU found: tpu='local' but this host has no TPU device "
                f"({dev_dir}/accel*, {dev_dir}/vfio/N); {_NO_TPU_HINT}."
            )
        return tpu
    if tpu.startswith("grpc://"):
        try:
            parse_address(tpu[len("grpc://"):], where="TPU address")
        except TFConfigError as error:
            raise ValueError(str(error)) from None
        return tpu
    if "://" in tpu:
        raise ValueError(f"TPU address {tpu!r}: only grpc://HOST:PORT addresses are supported.")
    if tpu:
        return tpu
    colab = environ.get("COLAB_TPU_ADDR", "").strip()
    if colab:
        return colab if colab.startswith("grpc://") else f"grpc://{colab}"
    name = environ.get("TPU_NAME", "").strip()
    if name:
        return name
    if local_tpu_devices(dev_dir) or environ.get("TPU_ACCELERATOR_TYPE"):
        return "local"
    raise TPUNotFoundError(
        f"no TPU found: COLAB_TPU_ADDR, TPU_NAME and TPU_ACCELERATOR_TYPE are unset and this "
        f"host has no TPU device ({dev_dir}/accel*, {dev_dir}/vfio/N); {_NO_TPU_HINT}."
    )


def connect_tpu(tpu: str = "", timeout_s: float = 60.0) -> Any:
    """Connects and initialises the TPU; returns its ``TPUClusterResolver``.

    Runs ``TPUClusterResolver(tpu=ADDRESS)``, ``tf.config.experimental_connect_to_cluster``
    and ``tf.tpu.experimental.initialize_tpu_system`` in a daemon thread and waits at most
    ``timeout_s`` seconds. Call it once per process, before building the strategy
    (``tf.distribute.TPUStrategy(resolver)``). After a timeout the thread may still be
    blocked inside TensorFlow: end the process rather than retrying in it.

    Raises:
      TPUNotFoundError: no TPU found (fast, before TensorFlow is imported).
      TPUConnectError: a step failed, or did not finish within ``timeout_s`` (the message
        names the address and the step that was waiting).
    """
    address = resolve_tpu(tpu)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    state: dict[str, Any] = {"step": "creating TPUClusterResolver"}

    def connect() -> None:
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            state["step"] = "connecting (tf.config.experimental_connect_to_cluster)"
            tf.config.experimental_connect_to_cluster(resolver)
            state["step"] = "initialising (tf.tpu.experimental.initialize_tpu_system)"
            tf.tpu.experimental.initialize_tpu_system(resolver)
            state["resolver"] = resolver
        except BaseException as error:  # reported in the caller's thread
            state["error"] = error

    thread = threading.Thread(target=connect, name="connect_tpu", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TPUConnectError(
            f"TPU {address!r} did not answer within {timeout_s:g} s (still {state['step']}). "
            f"Check that the name or address is right, that the TPU is READY and reachable "
            f"from this host, and that no other process holds it."
        )
    if "error" in state:
        error = state["error"]
        raise TPUConnectError(
            f"could not use TPU {address!r} while {state['step']}: "
            f"{type(error).__name__}: {error}"
        ) from error
    return state["resolver"]
