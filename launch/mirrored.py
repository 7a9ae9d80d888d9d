"""``python -m launch.mirrored``: one process, ``MirroredStrategy`` over chosen devices.

    python -m launch.mirrored [--gpus 0,1] [--virtual_devices N] TRAINER_FLAGS...

* ``--gpus 0,1``: ``CUDA_VISIBLE_DEVICES=0,1`` is set in the environment before
  TensorFlow loads (the trainer is exec'ed with it), so TensorFlow sees exactly those
  GPUs, renumbered ``/gpu:0..``; without ``--gpus`` the environment is left as it is.
* ``--virtual_devices N``: passes ``--config.distribute.virtual_devices=N``: the first
  physical device (the CPU on a machine without GPUs) is split into N logical devices,
  and Mirrored runs one replica on each. It needs at most one GPU in ``--gpus``.

Then it execs ``python -m trainer.main FLAGS --config.distribute.strategy=mirrored``,
after printing the devices it chose; the trainer prints its own device report.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launch.flags import sets_flag

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


def plan(gpus: str | None, virtual_devices: int, trainer_flags: Sequence[str],
         environ: dict[str, str], module: str = "trainer.main") -> tuple[list[str], dict[str, str], str]:
    """Returns ``(argv, env, description)`` of the trainer process to exec.

    Raises:
      ValueError: bad ``--gpus``, ``virtual_devices < 0``, virtual devices over several
        GPUs, or trainer flags that set what this launcher sets.
    """
    for name in _OWN_FLAGS:
        if sets_flag(trainer_flags, name):
            raise ValueError(f"{name} is set by this launcher; remove it from the trainer flags.")
    if virtual_devices < 0:
        raise ValueError(f"--virtual_devices={virtual_devices} must be >= 0.")
    env = dict(environ)
    argv = [sys.executable, "-m", module, *trainer_flags, "--config.distribute.strategy=mirrored"]
    if gpus is not None:
        ids = parse_gpus(gpus)
        if virtual_devices > 1 and len(ids) > 1:
            raise ValueError(f"--virtual_devices splits one device; with --gpus={gpus} give a "
                             f"single GPU id or drop --virtual_devices.")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: set the devices, then exec the trainer."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.mirrored", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--gpus 0,1] [--virtual_devices N] TRAINER_FLAGS...")
    parser.add_argument("--gpus", help="comma-separated GPU ids (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--virtual_devices", type=int, default=0,
                        help="split the first device into N logical devices")
    parser.add_argument("--module", default="trainer.main", help="entry point run with python -m")
    args, trainer_flags = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        command, env, devices = plan(args.gpus, args.virtual_devices, trainer_flags,
                                     dict(os.environ), args.module)
    except ValueError as error:
        parser.error(str(error))
    print(f"[launch.mirrored] MirroredStrategy over {devices}; running: "
          f"{' '.join(command[1:])}", file=sys.stderr, flush=True)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    sys.exit(main())
