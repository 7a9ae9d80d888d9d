"""``python -m launch.mirrored``: one process, ``MirroredStrategy`` over chosen devices.

    python -m launch.mirrored [--gpus 0,1] [--virtual_devices N] TRAINER_FLAGS...

* ``--gpus 0,1``: ``CUDA_VISIBLE_DEVICES=0,1`` is set in the environment before
  TensorFlow loads (the trainer is exec'ed with it), so TensorFlow sees exactly those
  GPUs, renumbered ``/gpu:0..``; without ``--gpus`` the environment is left as it is.
  Every id must be a GPU this machine offers (:func:`launch.gpus.found_gpus`:
  ``CUDA_VISIBLE_DEVICES`` when set, else ``/dev/nvidiaN``, else ``nvidia-smi -L``);
  otherwise the launcher stops with the GPUs it found, instead of TensorFlow quietly
  falling back to one CPU replica.
* ``--virtual_devices N`` (N >= 1): passes ``--config.distribute.virtual_devices=N``:
  the first physical device (the CPU on a machine without GPUs) is split into N logical
  devices, and Mirrored runs one replica on each. It needs at most one GPU in ``--gpus``.

A refused argument exits 2 with the reason as the last line, before the trainer starts.
Then, before TensorFlow loads, the launcher runs ``trainer.main``'s TensorFlow-free checks
once (``--check_only``, :func:`launch.group.check_trainer_command`): flags, config file,
workdir and, when the replica count is known here (:func:`known_replicas`), that
``train.global_batch_size`` and ``eval.global_batch_size`` divide over it; a failure
exits with the check's status (1 config, 2 usage) and its one-line error last.

Then it execs ``python -m trainer.main FLAGS --config.distribute.strategy=mirrored``,
after printing the devices it chose; the trainer prints its own device report.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launch.flags import sets_flag, with_absolute_paths
from launch.gpus import FoundGpus, found_gpus, missing_gpus
from launch.group import CHECKED_MODULE, check_trainer_command

_OWN_FLAGS = ("--config.distribute.strategy", "--config.distribute.virtual_devices")


def parse_gpus(text: str) -> list[int]:
    """``"0,1"`` → ``[0, 1]``; raises ValueError for anything but distinct integers >= 0."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus={text!r} must be comma-separated GPU ids, e.g. 0,1.") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus={text!r} must list distinct ids >= 0, e.g. 0,1.")
    return ids


def check_gpus_found(gpus: str, ids: Sequence[int], found: FoundGpus) -> None:
    """Raises ValueError naming the GPUs found unless every id of ``ids`` is one."""
    missing = missing_gpus(ids, found)
    if not missing:
        return
    if not found.ids:
        raise ValueError(f"--gpus={gpus}: no GPU found ({found.source}). Drop "
                         f"--gpus to run on the CPU (--virtual_devices N splits it into N "
                         f"replicas).")
    raise ValueError(f"--gpus={gpus}: no GPU {', '.join(map(str, missing))} here; GPUs found: "
                     f"{found.describe()}. Give ids among them, or drop --gpus to use them all.")


def plan(gpus: str | None, virtual_devices: int | None, trainer_flags: Sequence[str],
         environ: dict[str, str], module: str = "trainer.main",
         found: FoundGpus | None = None) -> tuple[list[str], dict[str, str], str]:
    """Returns ``(argv, env, description)`` of the trainer process to exec.

    ``virtual_devices`` None leaves the config's value. ``found``: the GPUs the ids of
    ``gpus`` must be among (default :func:`launch.gpus.found_gpus` of ``environ``).

    Raises:
      ValueError: bad ``--gpus`` or GPUs not found, ``virtual_devices < 1``, virtual
        devices over several GPUs, or trainer flags that set what this launcher sets.
    """
    for name in _OWN_FLAGS:
        if sets_flag(trainer_flags, name):
            raise ValueError(f"{name} is set by this launcher; remove it from the trainer flags.")
    if virtual_devices is not None and virtual_devices < 1:
        raise ValueError(f"--virtual_devices={virtual_devices} must be >= 1 (the number of "
                         f"replicas the first device is split into, e.g. 2); drop it to run "
                         f"one replica per device.")
    env = dict(environ)
    argv = [sys.executable, "-m", module, *trainer_flags, "--config.distribute.strategy=mirrored"]
    if gpus is not None:
        ids = parse_gpus(gpus)
        if virtual_devices and virtual_devices > 1 and len(ids) > 1:
            raise ValueError(f"--virtual_devices splits one device; with --gpus={gpus} give a "
                             f"single GPU id or drop --virtual_devices.")
        check_gpus_found(gpus, ids, found_gpus(environ) if found is None else found)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        devices = f"GPUs {env['CUDA_VISIBLE_DEVICES']} (CUDA_VISIBLE_DEVICES, seen as " + \
                  ", ".join(f"/gpu:{i}" for i in range(len(ids))) + ")"
    else:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        devices = ("all GPUs" if visible is None else f"GPUs {visible!r} (CUDA_VISIBLE_DEVICES)") + \
                  ", or the CPU if there are none"
    if virtual_devices:
        argv.append(f"--config.distribute.virtual_devices={virtual_devices}")
        devices = f"{virtual_devices} virtual devices on the first device of: {devices}"
    return argv, env, devices


def known_replicas(gpus: str | None, virtual_devices: int | None,
                   environ: dict[str, str]) -> int:
    """The replicas the Mirrored run will have, as far as this process knows without
    TensorFlow: ``virtual_devices`` when given, else the ids of ``gpus``, else the GPUs
    found (:func:`launch.gpus.found_gpus`); 0 (unknown) on a machine without GPUs,
    where the config's own ``distribute.virtual_devices`` decides (the trainer checks
    it). Call after :func:`plan` accepted the arguments."""
    if virtual_devices:
        return virtual_devices
    if gpus is not None:
        return len(parse_gpus(gpus))
    return len(found_gpus(environ).ids)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: set the devices, then exec the trainer."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.mirrored", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--gpus 0,1] [--virtual_devices N] TRAINER_FLAGS...")
    parser.add_argument("--gpus", help="comma-separated GPU ids (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--virtual_devices", type=int, default=None,
                        help="split the first device into N >= 1 logical devices")
    parser.add_argument("--module", default="trainer.main", help="entry point run with python -m")
    args, trainer_flags = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    trainer_flags = with_absolute_paths(trainer_flags)
    try:
        command, env, devices = plan(args.gpus, args.virtual_devices, trainer_flags,
                                     dict(os.environ), args.module)
    except ValueError as error:
        parser.error(str(error))
    if args.module == CHECKED_MODULE:
        status = check_trainer_command(
            command, env,
            lambda line: print(line, file=sys.stderr, flush=True),
            known_replicas(args.gpus, args.virtual_devices, dict(os.environ)),
            refused="the trainer was not started", prefix="[launch.mirrored]")
        if status:
            return status
    print(f"[launch.mirrored] MirroredStrategy over {devices}; running: "
          f"{' '.join(command[1:])}", file=sys.stderr, flush=True)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    sys.exit(main())
