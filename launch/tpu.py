"""``python -m launch.tpu``: find the TPU, then run the trainer on it.

Command line::

    python -m launch.tpu [--tpu local|NAME|grpc://HOST:PORT] \\
        --config=... --workdir=... [TRAINER_FLAGS...]

finds the TPU (:func:`tf_cluster.tpu.resolve_tpu`: ``COLAB_TPU_ADDR``, ``TPU_NAME``, a
local TPU device or ``TPU_ACCELERATOR_TYPE``; fails at once, without TensorFlow, when
there is none) and execs ``python -m trainer.main FLAGS --config.distribute.strategy=tpu
--config.distribute.tpu=ADDRESS --config.precision.policy=mixed_bfloat16`` (the policy
only when the flags do not set one). The trainer connects with
:func:`tf_cluster.tpu.connect_tpu`.

Before the exec, ``trainer.main``'s TensorFlow-free checks run once (``--check_only``,
:func:`launch.group.check_trainer_command`: flags, config file, workdir); a failure exits
with the check's status and its one-line error last. The number of TPU cores, and so
whether the global batch sizes divide over them, is known only once TensorFlow has
connected: the trainer checks that.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launch.flags import sets_flag, with_absolute_paths
from launch.group import CHECKED_MODULE, check_trainer_command
from tf_cluster.tpu import TPUNotFoundError, resolve_tpu


def trainer_argv(address: str, trainer_flags: Sequence[str], module: str = "trainer.main") -> list[str]:
    """The trainer command for a TPU run on ``address`` (adds mixed_bfloat16 if unset)."""
    argv = [sys.executable, "-m", module, *trainer_flags,
            "--config.distribute.strategy=tpu", f"--config.distribute.tpu={address}"]
    if not sets_flag(trainer_flags, "--config.precision.policy"):
        argv.append("--config.precision.policy=mixed_bfloat16")
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: detect the TPU, then exec the trainer on it."""
    parser = argparse.ArgumentParser(
        prog="python -m launch.tpu", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--tpu local|NAME|grpc://HOST:PORT] TRAINER_FLAGS...")
    parser.add_argument("--tpu", default="", help="'' (detect), local, a TPU name or grpc://HOST:PORT")
    parser.add_argument("--module", default="trainer.main", help="entry point run with python -m")
    args, trainer_flags = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    trainer_flags = with_absolute_paths(trainer_flags)
    for name in ("--config.distribute.strategy", "--config.distribute.tpu"):
        if sets_flag(trainer_flags, name):
            parser.error(f"{name} is set by this launcher; use --tpu instead.")
    try:
        address = resolve_tpu(args.tpu)
    except (TPUNotFoundError, ValueError) as error:
        print(f"launch.tpu: {error}", file=sys.stderr)
        return 1
    command = trainer_argv(address, trainer_flags, args.module)
    if args.module == CHECKED_MODULE:
        status = check_trainer_command(command, dict(os.environ),
                                       lambda line: print(line, file=sys.stderr, flush=True),
                                       refused="the trainer was not started",
                                       prefix="[launch.tpu]")
        if status:
            return status
    print(f"[launch.tpu] TPU {address!r}; running: {' '.join(command[1:])}", file=sys.stderr,
          flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    sys.exit(main())
