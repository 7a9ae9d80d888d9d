"""A user's mistakes end in one clear message, fast, never in a traceback.

Three groups:

* command lines (``trainer.main``, ``trainer.doctor``, ``launch.multiworker``), one
  subprocess per case, each with ``import tensorflow`` made to fail: every flag, config
  file and workdir error is reported before TensorFlow is imported;
* the user's data and model meeting (first batch, runtime errors), devices, ports and
  ``checkpoint.best_metric``: in this process, with the tiny toy Trainer;
* the output contract itself: the exit statuses, ``--traceback``, internal errors, the
  ``result:`` line and the progress bar next to log lines.
"""

from __future__ import annotations

import errno as errno_codes
import io
import logging
import os
import re
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_cluster.tf_config import build_tf_config
from tests.support import toy
from tests.conftest import REPO, early_main, subprocess_env
from tests.support.helpers import NO_TENSORFLOW_PRELUDE, last_lines
from trainer import Callback, Trainer, errors
import trainer as trainer_package
from trainer.checks import inputs
from trainer.config import ConfigError
from trainer.errors import InputError
from trainer.telemetry.progress import Progress

DIGITS = str(REPO / "models" / "configs" / "digits.py")


def run_without_tensorflow(module: str, *args: str, env: dict | None = None):
    """Runs ``python -m module args`` with ``import tensorflow`` failing."""
    return subprocess.run([sys.executable, "-c", NO_TENSORFLOW_PRELUDE, module, *args],
                          cwd=REPO, env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory) -> dict:
    """Config files with the mistakes a config file can hold, and a file as workdir."""
    root = tmp_path_factory.mktemp("configs")
    files = {
        "syntax": "def get_config(:\n",
        "no_get_config": "import ml_collections\nCONFIG = ml_collections.ConfigDict()\n",
        "raises": "def get_config():\n    raise ValueError('no dataset named foo')\n",
        "bad_import": "import no_such_module_xyz\n\ndef get_config():\n    pass\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = root / f"{name}.py"
        paths[name].write_text(text)
    paths["a_file"] = root / "a_file.txt"
    paths["a_file"].write_text("not a directory")
    return paths


# (id, module, args (CONFIG / WORKDIR / FILE:<name> are replaced), exit status,
#  a regex the last three lines of stderr must match)
CLI_CASES = [
    ("override_key_typo", "trainer.main", ["--config.train.stepz=5"], 2,
     r"Usage error: --config\.train\.stepz=5: config\.train has no field 'stepz'\. "
     r"Did you mean config\.train\.steps\?"),
    ("override_section_typo", "trainer.main", ["--config.trainz.steps=5"], 2,
     r"config has no field 'trainz'\. Did you mean config\.train\?"),
    ("override_free_form_key", "trainer.main", ["--config.model.hiden=3"], 2,
     r"config\.model has no field 'hiden' in .*digits\.py.*add config\.model\.hiden = \.\.\."),
    ("override_value_type", "trainer.main", ["--config.train.steps=abc"], 2,
     r"--config\.train\.steps=abc: invalid literal for int\(\).*the field's type"),
    ("config_value", "trainer.main", ["--config.train.steps=0"], 1,
     r"Configuration error: config\.train\.steps=0 must be a positive integer"),
    ("trainer_module_typo", "trainer.main", ["--config.trainer=models.digitz:DigitsTrainer"], 1,
     r"config\.trainer='models\.digitz:DigitsTrainer': module 'models\.digitz' cannot be found"),
    ("data_service_with_deterministic_input", "trainer.main",
     ["--config.data.service=127.0.0.1:5050"], 1,
     r"Configuration error: config\.data\.service='127\.0\.0\.1:5050' with "
     r"train\.deterministic=True: .* Set --config\.train\.deterministic=False"),
    ("batch_over_the_launchers_replicas", "trainer.main", ["--check_only", "--check_replicas=3"],
     1, r"Configuration error: config\.train\.global_batch_size=64 is not divisible by 3 "
        r"replicas; use a multiple of 3 \(e\.g\. 63 or 66\), or run on a number of replicas "
        r"\(workers x devices per worker\) that divides 64\.$"),
    ("eval_batch_over_the_launchers_replicas", "trainer.main",
     ["--check_only", "--check_replicas=4", "--config.eval.global_batch_size=30"], 1,
     r"config\.eval\.global_batch_size=30 is not divisible by 4 replicas"),
    ("check_replicas_negative", "trainer.main", ["--check_only", "--check_replicas=-1"], 2,
     r"Usage error: --check_replicas=-1: -1 is not a non-negative integer"),
    ("unknown_flag", "trainer.main", ["--workdirr=/tmp/x"], 2,
     r"unknown flag --workdirr\. Did you mean --workdir\?"),
    ("positional_argument", "trainer.main", ["train"], 2, r"unexpected arguments: train"),
    ("missing_config_flag", "trainer.main", ["NO_CONFIG"], 2,
     r"--config is required, e\.g\. --config=models/configs/digits\.py"),
    ("missing_workdir_flag", "trainer.main", ["NO_WORKDIR"], 2, r"--workdir is required"),
    ("config_file_missing", "trainer.main", ["CONFIG=/no/such/config.py"], 2,
     r"--config=/no/such/config\.py: no such file"),
    ("config_file_syntax", "trainer.main", ["CONFIG=FILE:syntax"], 1,
     r"Config file error: .*syntax\.py line 1: invalid syntax"),
    ("config_file_no_get_config", "trainer.main", ["CONFIG=FILE:no_get_config"], 1,
     r"no_get_config\.py defines no get_config\(\)"),
    ("config_file_get_config_raises", "trainer.main", ["CONFIG=FILE:raises"], 1,
     r"raises\.py line 2 \(in get_config\): loading the config raised ValueError: "
     r"no dataset named foo"),
    ("config_file_bad_import", "trainer.main", ["CONFIG=FILE:bad_import"], 1,
     r"bad_import\.py line 1 .*ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("workdir_is_a_file", "trainer.main", ["WORKDIR=FILE:a_file"], 1,
     r"Workdir error: --workdir=.*a_file\.txt is a file, not a directory"),
    ("workdir_below_a_file", "trainer.main", ["WORKDIR=FILE:a_file/run"], 1,
     r"cannot write .*a_file\.txt/run.*not a directory"),
    ("doctor_sections", "trainer.doctor", ["--sections=baseline,speed"], 2,
     r"--sections=baseline,speed: unknown section\(s\) speed; choose .* from baseline"),
    ("doctor_unknown_flag", "trainer.doctor", ["--workdir=/tmp/x"], 2,
     r"unknown flag --workdir\. python -m trainer\.doctor's flags: --config, --json"),
    ("doctor_override_typo", "trainer.doctor", ["--config.train.global_batch_sise=8"], 2,
     r"Did you mean config\.train\.global_batch_size\?"),
]


def _argv(module: str, args: list[str], paths: dict, tmp_path) -> list[str]:
    config, workdir = DIGITS, str(tmp_path / "run")
    rest = []
    for arg in args:
        if arg in ("NO_CONFIG", "NO_WORKDIR"):
            config = None if arg == "NO_CONFIG" else config
            workdir = None if arg == "NO_WORKDIR" else workdir
        elif arg.startswith(("CONFIG=", "WORKDIR=")):
            key, value = arg.split("=", 1)
            if value.startswith("FILE:"):
                name, _, tail = value[5:].partition("/")
                value = str(paths[name]) + (f"/{tail}" if tail else "")
            config, workdir = (value, workdir) if key == "CONFIG" else (config, value)
        else:
            rest.append(arg)
    argv = [f"--config={config}"] if config else []
    if workdir and module == "trainer.main":
        argv.append(f"--workdir={workdir}")
    return [*argv, *rest]


@pytest.mark.parametrize("case, module, args, status, message", CLI_CASES,
                         ids=[c[0] for c in CLI_CASES])
def test_command_line_mistake_ends_in_one_message_before_tensorflow(
        bad_configs, tmp_path, case, module, args, status, message):
    proc = run_without_tensorflow(module, *_argv(module, args, bad_configs, tmp_path))
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "TENSORFLOW IMPORTED" not in proc.stderr
    assert re.search(message, last_lines(proc.stderr)), proc.stderr[-3000:]


def test_check_only_passes_a_good_command_without_tensorflow(tmp_path):
    """Positive control for the table above: the same prelude, a valid command."""
    proc = run_without_tensorflow("trainer.main", f"--config={DIGITS}",
                                  f"--workdir={tmp_path}", "--config.train.steps=10",
                                  "--check_only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok: ")
    divides = run_without_tensorflow("trainer.main", f"--config={DIGITS}",
                                     f"--workdir={tmp_path}", "--check_only",
                                     "--check_replicas=4")  # 64 over 4 replicas
    assert divides.returncode == 0, divides.stderr[-3000:]


def test_check_only_leaves_a_bucket_to_the_job(tmp_path):
    """A launcher's --check_only runs where the job is submitted, which may neither reach
    the job's bucket nor hold its credentials (none here): not a Workdir error."""
    proc = run_without_tensorflow("trainer.main", f"--config={DIGITS}",
                                  "--workdir=gs://no-such-bucket-here/run", "--check_only",
                                  "--config.data.data_dir=gs://no-such-bucket-here/tfds")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok: ") and "checked when the job starts" in proc.stdout


def test_traceback_is_shown_on_request_and_the_message_stays_last(tmp_path):
    for extra, env in ((["--traceback"], {}), ([], {errors.TRACEBACK_ENV: "1"})):
        proc = run_without_tensorflow("trainer.main", f"--config={DIGITS}",
                                      f"--workdir={tmp_path}", "--config.train.stepz=5",
                                      *extra, env=env)
        assert proc.returncode == 2
        assert "Traceback" in proc.stderr and "KeyError" in proc.stderr
        assert last_lines(proc.stderr, 1).startswith("Usage error: --config.train.stepz=5")


@pytest.mark.parametrize("flags, message", [
    ([], r"--config is required"),
    (["--config=/no/such/config.py"], r"--config=/no/such/config\.py: no such file"),
])
def test_launcher_checks_the_shared_flags_once_before_starting_a_task(tmp_path, flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.multiworker", "--workers", "2", *flags,
         f"--workdir={tmp_path}"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "[launcher] starting" not in proc.stderr
    assert len(re.findall(message, proc.stderr)) == 1, proc.stderr
    assert re.search(message, last_lines(proc.stderr)), proc.stderr


def test_launcher_help_shows_the_defaults():
    proc = subprocess.run([sys.executable, "-m", "launch.multiworker", "--help"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert re.search(r"--start_timeout S .*\n?.*\(default: 300\.0\)", proc.stdout)


def test_main_help_lists_the_config_fields():
    proc = run_without_tensorflow("trainer.main", "--help")
    assert "--config.SECTION.FIELD=VALUE" in proc.stdout + proc.stderr
    assert "global_batch_size=64" in proc.stdout + proc.stderr


# ------------------------------------------------------------- data meets model (in-process)
def _dataset(x, y, batch=32):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)


class WrongFeatureShape(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data()
        return _dataset(x[:, :7], y)


class StringFeatures(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data()
        return _dataset(np.full(x.shape, "a"), y)


class LabelsOutsideClasses(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data()
        return _dataset(x, y + 5)  # the model has 3 classes


class EmptyRepeated(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data()
        return (tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: b > 99)
                .repeat().batch(32, drop_remainder=True))


class ShorterThanOneStep(toy.ToyTrainer):
    def build_train_dataset(self, ctx):
        x, y = toy.toy_data(10)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True).repeat()


class LossPerClass(toy.ToyTrainer):
    def compute_loss(self, batch, outputs):
        return tf.square(outputs)  # [b, 3]: not one loss per example


@pytest.mark.parametrize("trainer_cls, message", [
    (WrongFeatureShape, r"build_train_dataset yields features of shape \(32, 7\) float32 but "
                        r"build_model's model input #0 expects shape \(None, 8\) float32"),
    (StringFeatures, r"features of shape \(32, 8\) string but .* expects .* float32"),
    (LabelsOutsideClasses, r"step 1: .*label value of \d.*outside the valid range.*labels "
                           r"must lie in \[0, number of classes\): fix the labels in "
                           r"build_train_dataset"),
    (EmptyRepeated, r"build_train_dataset yields no batch at all.*\.repeat\(\) cannot help"),
    (ShorterThanOneStep, r"build_train_dataset yields no batch at all: .*fewer examples than "
                         r"one per-replica batch \(32\)"),
    (LossPerClass, r"compute_loss returned shape \(32, 3\); it must return the per-example"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_data_and_model_mismatch_names_the_hook(trainer_cls, message):
    trainer = trainer_cls(toy.toy_config(**{"train.steps": 2, "train.steps_per_loop": 1}))
    with pytest.raises(InputError, match=message):
        trainer.fit()
    assert trainer.step == 0


def test_feature_check_accepts_what_keras_accepts():
    """Negative control of the shape check: Keras adds/drops a trailing 1 itself."""
    images = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten()])
    inputs.check_features(tf.TensorSpec((None, 28, 28), tf.uint8), images, "build_train_dataset")
    inputs.check_features((tf.TensorSpec((4, 28, 28, 1), tf.float16),), images, "x")
    with pytest.raises(InputError, match=r"x yields features of shape \(4, 28, 27\)"):
        inputs.check_features(tf.TensorSpec((4, 28, 27), tf.float32), images, "x")
    with pytest.raises(InputError, match=r"yields 2 feature tensor\(s\) but build_model's "
                                         r"model has 1 input"):
        inputs.check_features((tf.TensorSpec((4, 784)),) * 2, images, "x")


def test_best_metric_that_eval_never_produces_fails_at_fit_start(tmp_path):
    trainer = toy.ToyEvalTrainer(toy.toy_config(**{"checkpoint.best_metric": "eval/acuracy"}),
                                 str(tmp_path))
    with pytest.raises(ConfigError, match=r"best_metric='eval/acuracy' is not a value eval "
                                          r"produces \(eval/accuracy, eval/loss"):
        trainer.fit()
    assert trainer.step == 0


@pytest.mark.parametrize("dcfg, message", [
    ({"distribute.strategy": "one_device", "distribute.devices": ("/gpu:7",)},
     r"config\.distribute\.devices: '/gpu:7' is not a device of this process, which has "
     r"/device:CPU:0"),
    ({"distribute.strategy": "mirrored", "distribute.devices": ("/cpu:0", "/gpu:7")},
     r"'/gpu:7' is not a device of this process"),
    ({"distribute.strategy": "tpu"},
     r"config\.distribute\.strategy='tpu': no TPU found"),
])
def test_a_device_the_user_named_must_exist(dcfg, message, monkeypatch):
    for name in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=message):
        toy.ToyTrainer(toy.toy_config(**dcfg))


def test_a_taken_tf_config_port_names_the_address_and_the_holder(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        cluster = {"worker": [address, "127.0.0.1:1"]}
        monkeypatch.setenv("TF_CONFIG", str(build_tf_config(cluster, "worker", 0)).replace(
            "'", '"'))
        with pytest.raises(ConfigError) as raised:
            toy.ToyTrainer(toy.toy_config(**{"distribute.strategy": "multi_worker"}))
    text = str(raised.value)
    assert f"worker:0 listens on {address}" in text
    assert "Address already in use" in text  # what the local launcher retries on
    assert f"held by pid {os.getpid()}" in text


# ------------------------------------------------------------------- the output contract
def test_report_prints_a_user_error_as_one_last_line_and_a_bug_with_its_traceback(capsys):
    assert errors.report(ConfigError("config.train.steps=0 must be > 0.")) == 1
    assert errors.report(errors.UsageError("unknown flag --x.")) == 2
    out = capsys.readouterr().err
    assert "Traceback" not in out
    assert out.splitlines() == ["Configuration error: config.train.steps=0 must be > 0.",
                                "Usage error: unknown flag --x."]
    try:
        {}["missing"]
    except KeyError as bug:
        assert errors.report(bug) == 1
    out = capsys.readouterr().err
    assert "Traceback" in out
    assert last_lines(out, 1).startswith("Internal error (a bug in tf-trainer or in the "
                                         "Trainer subclass")


def test_a_full_or_read_only_disk_is_a_workdir_error():
    full = errors.write_error(OSError(errno_codes.ENOSPC, "No space left on device", "/r/x"),
                              "--workdir=/r")
    assert re.match(r"cannot write /r/x \(--workdir=/r\): the disk is full", str(full))
    ro = errors.write_error(OSError(errno_codes.EROFS, "Read-only file system"), "--workdir=/r")
    assert "the file system is read-only" in str(ro) and "--workdir" in str(ro)
    assert errors.write_error(OSError(errno_codes.ECONNRESET, "reset"), "x") is None


digits_main = early_main("digits_main", "test_a_run_ends_with_a_plain_result_line_on_stdout",
                         "--config.train.steps=20", "--config.train.log_every_steps=10",
                         "--config.eval.every_steps=0", "--config.telemetry.progress=bar",
                         "--config.train.on_nonfinite=skip")  # checked: skipped_steps=


def test_a_run_ends_with_a_plain_result_line_on_stdout(digits_main):
    proc, tmp_path = digits_main.result(), digits_main.workdir
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
    assert len(result) == 1, proc.stdout
    fields = dict(part.split("=", 1) for part in result[0].split()[1:])
    assert fields["step"] == "20"
    assert 0 <= float(fields["eval/accuracy"]) <= 1 and float(fields["train/loss"]) > 0
    assert fields["checkpoint"] == str(tmp_path / "checkpoints" / "20")
    assert fields["skipped_steps"] == "0"  # the run checks its updates (on_nonfinite=skip)
    assert float(fields["time_s"]) > 0
    assert "final: {" in proc.stderr  # the log line scripts and tests already read


def test_the_progress_bar_is_erased_before_a_log_line():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress("bar", 10, stream)
        progress.update(5, 0.5, None, None)
        logging.getLogger("some.library").warning("a log line")
        progress.close()
        logging.getLogger("some.library").warning("after close")
    finally:
        root.removeHandler(handler)
    text = stream.getvalue()
    bar_end = text.index("ETA")
    assert "\r\x1b[Ka log line\n" in text[bar_end:], repr(text)
    assert text.endswith("after close\n") and "\x1b[Kafter close" not in text


def test_trainer_names_load_lazily_and_behave_as_before():
    package = trainer_package
    assert package.Trainer is Trainer and package.Callback is Callback
    assert issubclass(toy.ToyTrainer, package.Trainer)
    assert {"Trainer", "Callback"} <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        package.Trainr  # noqa: B018
