"""Specification of ``python -m launch.mirrored``: device choice before TensorFlow loads."""

import json
import os
import subprocess
import sys

import pytest

from tests.launch_helpers.running import REPO

ECHO = ["--module", "tests.launch_helpers.echo_argv"]


def run_mirrored(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "launch.mirrored", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def echoed(result):
    line = next(l for l in result.stdout.splitlines() if l.startswith("ECHO "))
    return json.loads(line[5:])


def test_gpus_set_cuda_visible_devices_in_the_trainer_environment():
    result = run_mirrored(["--gpus", "0,2", *ECHO, "--config=c.py"])
    assert result.returncode == 0, result.stderr
    assert echoed(result) == {"argv": ["--config=c.py", "--config.distribute.strategy=mirrored"],
                              "CUDA_VISIBLE_DEVICES": "0,2"}
    assert "MirroredStrategy over GPUs 0,2 (CUDA_VISIBLE_DEVICES, seen as /gpu:0, /gpu:1)" \
        in result.stderr


def test_without_gpus_the_environment_is_left_alone():
    result = run_mirrored([*ECHO], {"CUDA_VISIBLE_DEVICES": "3"})
    assert result.returncode == 0, result.stderr
    assert echoed(result)["CUDA_VISIBLE_DEVICES"] == "3"


def test_virtual_devices_are_passed_to_the_trainer():
    result = run_mirrored(["--virtual_devices", "2", *ECHO, "--workdir=/tmp/w"])
    assert result.returncode == 0, result.stderr
    assert echoed(result)["argv"] == ["--workdir=/tmp/w", "--config.distribute.strategy=mirrored",
                                      "--config.distribute.virtual_devices=2"]
    assert "2 virtual devices on the first device" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0,x"], "must be comma-separated GPU ids"),
    (["--gpus", "1,1"], "distinct ids"),
    (["--gpus", "0,1", "--virtual_devices", "2"], "splits one device"),
    (["--virtual_devices", "-1"], "must be >= 0"),
    (["--config.distribute.strategy=one_device"], "set by this launcher"),
])
def test_bad_arguments_exit_2_with_the_reason(args, message):
    result = run_mirrored([*ECHO, *args])
    assert result.returncode == 2
    assert message in result.stderr

