"""Specification: every launcher refuses what it cannot honour before any task starts.

Each row runs the real command as a subprocess (nothing imports TensorFlow on these
paths, so each takes about a second) and checks its exit status (2 for a usage error,
1 for a config error, as ``trainer.main``), its exact last line, that the message is
printed once and without a traceback, and that nothing was started or written.
"""

import os
import shutil
import subprocess
import sys

import pytest

from launch import multiworker
from launch.gpus import gpu_device_files
from tests.support.helpers import NO_TENSORFLOW_PRELUDE
from tests.launch_helpers.running import REPO

DIGITS = "--config=models/configs/digits.py"  # train.global_batch_size=64
NO_GPU = ("no CUDA_VISIBLE_DEVICES, no /dev/nvidiaN device, no nvidia-smi")
SLURM_TIME_FORMS = (
    "give 'minutes', 'minutes:seconds', 'hours:minutes:seconds', 'days-hours', "
    "'days-hours:minutes' or 'days-hours:minutes:seconds' (e.g. 90, 4:00:00, 1-00:00:00), "
    "or UNLIMITED.")
NOT_DIVISIBLE_BY_3 = ("Configuration error: config.train.global_batch_size=64 is not "
                      "divisible by 3 replicas; use a multiple of 3 (e.g. 63 or 66), or run on "
                      "a number of replicas (workers x devices per worker) that divides 64.")


def run(module, args, env_extra=None, without_tensorflow=False):
    """``python -m module args`` in the repository; returns (status, stdout, lines).
    ``without_tensorflow``: ``import tensorflow`` (or keras) fails in that process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES", "COLAB_TPU_ADDR", "TPU_NAME",
                        "TPU_ACCELERATOR_TYPE")}
    env.update(PYTHONPATH=REPO, **(env_extra or {}))
    start = ["-c", NO_TENSORFLOW_PRELUDE] if without_tensorflow else ["-m"]
    result = subprocess.run([sys.executable, *start, module, *args], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return result.returncode, result.stdout, lines


def assert_one_clear_last_line(lines, last):
    assert lines and lines[-1] == last, "\n".join(lines)
    assert sum(line == last for line in lines) == 1, "\n".join(lines)
    assert not any("Traceback" in line or "Internal error" in line for line in lines), lines


@pytest.mark.parametrize("args, env, last", [
    pytest.param(
        ["--gpus", "0,1"], {},
        f"python -m launch.mirrored: error: --gpus=0,1: no GPU found ({NO_GPU}). Drop --gpus "
        f"to run on the CPU (--virtual_devices N splits it into N replicas).",
        marks=pytest.mark.skipif(bool(gpu_device_files() or shutil.which("nvidia-smi")),
                                 reason="this machine has GPUs")),
    (["--gpus", "0,3"], {"CUDA_VISIBLE_DEVICES": "0,1"},
     "python -m launch.mirrored: error: --gpus=0,3: no GPU 3 here; GPUs found: 0, 1 "
     "(CUDA_VISIBLE_DEVICES='0,1'). Give ids among them, or drop --gpus to use them all."),
    (["--gpus", "0"], {"CUDA_VISIBLE_DEVICES": "-1"},
     "python -m launch.mirrored: error: --gpus=0: no GPU found (CUDA_VISIBLE_DEVICES='-1'). "
     "Drop --gpus to run on the CPU (--virtual_devices N splits it into N replicas)."),
    (["--virtual_devices", "0"], {},
     "python -m launch.mirrored: error: --virtual_devices=0 must be >= 1 (the number of "
     "replicas the first device is split into, e.g. 2); drop it to run one replica per device."),
    (["--virtual_devices", "-2"], {},
     "python -m launch.mirrored: error: --virtual_devices=-2 must be >= 1 (the number of "
     "replicas the first device is split into, e.g. 2); drop it to run one replica per device."),
])
def test_mirrored_refuses_devices_it_cannot_give(args, env, last, tmp_path):
    code, _, lines = run("launch.mirrored", [*args, DIGITS, f"--workdir={tmp_path}"], env)
    assert code == 2, lines
    assert_one_clear_last_line(lines, last)
    assert not any(line.startswith("[launch.mirrored] MirroredStrategy over") for line in lines)
    assert os.listdir(tmp_path) == []  # the trainer never ran


@pytest.mark.parametrize("module, args, env, code, last", [
    ("launch.mirrored", ["--virtual_devices", "3"], {}, 1, NOT_DIVISIBLE_BY_3),
    ("launch.mirrored", ["--gpus", "0,1,2"], {"CUDA_VISIBLE_DEVICES": "0,1,2"}, 1,
     NOT_DIVISIBLE_BY_3),
    ("launch.mirrored", ["--virtual_devices", "2", "--config.eval.global_batch_size=33"], {}, 1,
     "Configuration error: config.eval.global_batch_size=33 is not divisible by 2 replicas; "
     "use a multiple of 2 (e.g. 32 or 34), or run on a number of replicas (workers x "
     "devices per worker) that divides 33."),
    ("launch.mirrored", ["--virtual_devices", "2", "--config.train.stepz=5"], {}, 2,
     "Usage error: --config.train.stepz=5: config.train has no field 'stepz'. Did you mean "
     "config.train.steps? Fields of config.train: deterministic, early_stopping, "
     "global_batch_size, log_every_steps, loss_upper_bound, max_rollbacks, on_nonfinite, "
     "rollback_after, steps, steps_per_loop."),
    ("launch.tpu", ["--config.train.global_batch_size=0"], {"TPU_NAME": "my-tpu"}, 1,
     "Configuration error: config.train.global_batch_size=0 must be a positive integer."),
])
def test_single_process_launchers_check_the_config_before_tensorflow_loads(
        module, args, env, code, last, tmp_path):
    """The launcher, where TensorFlow cannot be imported, refuses with the trainer's
    one-line error and never execs the trainer (which would load TensorFlow first)."""
    launcher = [a for a in args if not a.startswith("--config.")]
    flags = [a for a in args if a.startswith("--config.")]
    status, _, lines = run(module, [*launcher, DIGITS, f"--workdir={tmp_path}", *flags], env,
                           without_tensorflow=True)
    assert status == code, lines
    assert_one_clear_last_line(lines, last)
    assert lines[0] == (f"[{module}] the trainer was not started: the trainer flags fail "
                        f"trainer.main's checks."), lines
    assert not any(" running: " in line for line in lines), lines  # no exec of the trainer
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, code, last", [
    (["--workers", "3"], 1, NOT_DIVISIBLE_BY_3),
    (["--workers", "2", "--config.eval.global_batch_size=33"], 1,
     "Configuration error: config.eval.global_batch_size=33 is not divisible by 2 replicas; "
     "use a multiple of 2 (e.g. 32 or 34), or run on a number of replicas (workers x "
     "devices per worker) that divides 33."),
    (["--workers", "2", "--data_service_workers", "1", "--config.train.deterministic=True"], 2,
     "python -m launch.multiworker: error: --data_service_workers needs "
     "--config.train.deterministic=False (the tf.data service delivers batches in no fixed "
     "order) but the flags set --config.train.deterministic=True; drop that flag (the "
     "launcher then sets False) or drop --data_service_workers."),
    (["--workers", "2", "--data_service_workers", "1", "--config.train.deterministic"], 2,
     "python -m launch.multiworker: error: --data_service_workers needs "
     "--config.train.deterministic=False (the tf.data service delivers batches in no fixed "
     "order) but the flags set --config.train.deterministic=True; drop that flag (the "
     "launcher then sets False) or drop --data_service_workers."),
    (["--workers", "2", "--config.data.service=127.0.0.1:5050"], 1,
     "Configuration error: config.data.service='127.0.0.1:5050' with "
     "train.deterministic=True: the tf.data service delivers batches in an order that "
     "depends on its workers' timing, so the run can be neither reproduced nor resumed at "
     "the exact batch. Set --config.train.deterministic=False to accept that, or drop the "
     "service."),
])
def test_local_group_refuses_before_any_task_starts(args, code, last, tmp_path):
    launcher = [a for a in args if not a.startswith("--config.")]
    flags = [a for a in args if a.startswith("--config.")]
    status, _, lines = run("launch.multiworker",
                           [*launcher, DIGITS, f"--workdir={tmp_path}", *flags])
    assert status == code, lines
    assert_one_clear_last_line(lines, last)
    assert_no_task_started(lines)


def assert_no_task_started(lines):
    assert not any(line.startswith(("[launcher] starting", "[launcher] pids:", "[worker:",
                                    "[chief:", "[launcher] node_rank")) for line in lines), lines


@pytest.mark.parametrize("args, code, last", [
    (["--hosts", "127.0.0.1,127.0.0.2,127.0.0.3", "--node_rank", "0"], 1, NOT_DIVISIBLE_BY_3),
    (["--hosts", "127.0.0.1", "--node_rank", "0", "--tasks_per_node", "3"], 1,
     NOT_DIVISIBLE_BY_3),
    (["--hosts", "127.0.0.1,127.0.0.2", "--node_rank", "0", "--port", "0"], 2,
     "python -m launch.multiworker: error: --port=0 must be a TCP port in 1..65535."),
    (["--hosts", "127.0.0.1,127.0.0.2", "--node_rank", "0", "--port", "70000"], 2,
     "python -m launch.multiworker: error: --port=70000 must be a TCP port in 1..65535."),
])
def test_per_host_launcher_refuses_before_any_task_starts(args, code, last, tmp_path):
    status, _, lines = run("launch.multiworker", [*args, DIGITS, f"--workdir={tmp_path}"])
    assert status == code, lines
    assert_one_clear_last_line(lines, last)
    assert_no_task_started(lines)


@pytest.mark.parametrize("args, code, last", [
    (["--workers", "2", "--time", "abc"], 2,
     f"launch.multiworker: --time='abc' is not a SLURM time limit; {SLURM_TIME_FORMS}"),
    (["--workers", "2", "--time", "1:00:00:00"], 2,
     f"launch.multiworker: --time='1:00:00:00' is not a SLURM time limit; {SLURM_TIME_FORMS}"),
    (["--workers", "2", "--partition", "gpu/a"], 2,
     "launch.multiworker: --partition='gpu/a' is not a SLURM partition name or a "
     "comma-separated list of them (letters, digits, '_', '-', '.'; e.g. gpu or gpu,cpu)."),
    (["--workers", "2", "--account", "ml:team"], 2,
     "launch.multiworker: --account='ml:team' is not a SLURM account name (letters, digits, "
     "'_', '-', '.'; e.g. ml-team)."),
    (["--workers", "2", "--port", "70000"], 2,
     "python -m launch.multiworker: error: --port=70000 must be a TCP port in 1..65535."),
    (["--workers", "4", "--tasks_per_node", "2", "--port", "65535"], 2,
     "launch.multiworker: --port=65535: the tasks of a node listen on ports 65535..65536, "
     "which must lie in 1..65535; give --port in 1..65534."),
    (["--workers", "2", "--gpus_per_worker", "-1"], 2,
     "launch.multiworker: --gpus_per_worker=-1 must be >= 0."),
    (["--workers", "3"], 1, NOT_DIVISIBLE_BY_3),
    (["--workers", "2", "--gpus_per_worker", "3"], 1,
     "Configuration error: config.train.global_batch_size=64 is not divisible by 6 replicas; "
     "use a multiple of 6 (e.g. 60 or 66), or run on a number of replicas (workers x "
     "devices per worker) that divides 64."),
])
def test_emit_slurm_refuses_what_sbatch_or_the_job_would_reject(args, code, last):
    status, out, lines = run("launch.multiworker",
                             [*args, "--emit", "slurm", DIGITS, "--workdir=/shared/run"])
    assert status == code, lines
    assert out == ""
    assert_one_clear_last_line(lines, last)


VOLUME = ["--volume", "runs:/mnt/runs"]


@pytest.mark.parametrize("args, code, last", [
    (["--image", "Registry/Trainer"], 2,
     "launch.multiworker: --image='Registry/Trainer' is not a container image reference; "
     "write [REGISTRY[:PORT]/]PATH[:TAG][@sha256:DIGEST] with a lower-case PATH, e.g. "
     "'registry.example:5000/team/trainer:1.2'."),
    (["--image", "trainer:"], 2,
     "launch.multiworker: --image='trainer:' is not a container image reference; "
     "write [REGISTRY[:PORT]/]PATH[:TAG][@sha256:DIGEST] with a lower-case PATH, e.g. "
     "'registry.example:5000/team/trainer:1.2'."),
    (["--job_name", "Digits_1"], 2,
     "launch.multiworker: --job_name='Digits_1' cannot name a TFJob: it must be a DNS-1123 "
     "label (lower-case letters, digits and '-', starting and ending with a letter or digit) "
     "of at most 54 characters here (the operator names services Digits_1-worker-1), e.g. "
     "'mnist-run1'."),
    (["--job_name", "a" * 60], 2,
     f"launch.multiworker: --job_name='{'a' * 60}' cannot name a TFJob: it must be a DNS-1123 "
     f"label (lower-case letters, digits and '-', starting and ending with a letter or digit) "
     f"of at most 54 characters here (the operator names services {'a' * 60}-worker-1), e.g. "
     f"'mnist-run1'."),
    (["--volume", "runs-:/mnt/runs"], 2,
     "launch.multiworker: --volume claim 'runs-' is not a valid Kubernetes name (lower-case "
     "letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 "
     "characters)."),
    (["--cpu", "2 cores"], 2,
     "launch.multiworker: --cpu='2 cores' is not a Kubernetes quantity; write e.g. '4' or "
     "'500m' for CPUs, '16Gi' for memory."),
    (["--gpus_per_worker", "-1"], 2, "launch.multiworker: --gpus_per_worker=-1 must be >= 0."),
    (["--workers", "3"], 1, NOT_DIVISIBLE_BY_3),
])
def test_emit_tfjob_refuses_what_kubernetes_or_the_job_would_reject(args, code, last):
    workers = [] if "--workers" in args else ["--workers", "2"]
    image = [] if "--image" in args else ["--image", "registry.example/trainer:1"]
    volume = [] if "--volume" in args else VOLUME
    status, out, lines = run("launch.multiworker",
                             [*workers, *image, *volume, *args, "--emit", "tfjob", DIGITS,
                              "--workdir=/mnt/runs/digits"])
    assert status == code, lines
    assert out == ""
    assert_one_clear_last_line(lines, last)


def test_emitted_jobs_whose_size_varies_or_config_is_elsewhere_are_not_checked_here():
    status, out, lines = run("launch.multiworker",
                             ["--nodes", "1-3", "--emit", "slurm", DIGITS, "--workdir=/s/r"])
    assert status == 0 and out.startswith("#!/bin/bash"), lines
    status, out, lines = run("launch.multiworker",
                             ["--workers", "3", "--emit", "slurm",
                              "--config=/in/the/image/config.py", "--workdir=/s/r"])
    assert status == 0 and out.startswith("#!/bin/bash"), lines
    assert lines[-1] == ("[launcher] note: --config=/in/the/image/config.py is not on this "
                         "machine; the trainer flags were not checked (the job checks them "
                         "when it starts).")
    status, out, _ = run("launch.multiworker",
                         ["--workers", "3", "--emit", "slurm", "--no_check", DIGITS,
                          "--workdir=/s/r"])
    assert status == 0 and out.startswith("#!/bin/bash")


def test_the_data_service_gets_nondeterministic_input_with_one_note():
    args = multiworker.parse(["--workers", "2", "--data_service_workers", "1", DIGITS,
                              "--workdir=/tmp/w"])
    assert args.trainer_flags == [DIGITS, "--workdir=/tmp/w",
                                  "--config.train.deterministic=False"]
    assert args.notes == ["--data_service_workers: passing --config.train.deterministic=False "
                          "to the tasks (the tf.data service delivers batches in no fixed "
                          "order; model, optimizer and step still resume exactly, the batch "
                          "order does not)."]
    kept = multiworker.parse(["--workers", "2", "--data_service_workers", "1", DIGITS,
                              "--workdir=/tmp/w", "--config.train.deterministic=false"])
    assert kept.trainer_flags == [DIGITS, "--workdir=/tmp/w",
                                  "--config.train.deterministic=false"]
    assert kept.notes == []
