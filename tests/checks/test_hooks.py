"""A mistake in a user's hook is one clear last line naming the class, the hook, what it
returned (or raised) and what it must return; never "Internal error", never a traceback.

The Trainer subclasses with the mistakes live in tests/checks/hook_mistakes.py (``CASES``: the
class and the regex its message must match). Every one runs here, in this process
(``Trainer(...)`` or ``fit()`` raises :class:`trainer.errors.HookError`, one line). Under
``python -m trainer.main`` (one process per case, all started at once) run the cases
only a process shows: one hook mistake (the command prints any HookError as its one
last line; ``--traceback`` adds the trace, with another), those on 2 replicas, and data
that is not prepared.
"""

from __future__ import annotations

import re
import subprocess
import sys

import ml_collections
import pytest

from tests.checks import hook_mistakes
from tests.support import toy
from tests.conftest import REPO, subprocess_env
from tests.support.helpers import last_lines
from trainer.errors import HookError, InputError, UserError

CONFIG = str(REPO / "tests" / "checks" / "hook_mistakes.py")


def _fit(cls: type) -> None:
    config = toy.toy_config(**{"train.steps": 2, "train.steps_per_loop": 1,
                               "eval.every_steps": 1})
    cls(config).fit()


@pytest.mark.parametrize("name", sorted(hook_mistakes.CASES))
def test_a_wrong_hook_is_one_line_naming_class_hook_and_what_it_must_return(name):
    with pytest.raises(HookError) as raised:
        _fit(getattr(hook_mistakes, name))
    message = str(raised.value)
    assert "\n" not in message, message
    assert re.search(hook_mistakes.CASES[name], message), message


def test_the_loss_shape_stays_an_input_error_naming_the_class():
    class LossPerClass(toy.ToyTrainer):
        def compute_loss(self, batch, outputs):
            return outputs * outputs

    with pytest.raises(InputError, match=r"LossPerClass\.compute_loss returned shape "
                                         r"\(32, 3\); it must return the per-example loss, "
                                         r"shape \[per-replica batch\] = \[32\]"):
        _fit(LossPerClass)


def test_right_hooks_pass_the_checks():
    """Negative control: the toy Trainer's hooks (eval, metrics, callbacks) raise nothing."""
    class Good(toy.ToyEvalTrainer):
        def build_callbacks(self):
            return [hook_mistakes.Stopper()]

        def train_step(self, batch):
            return {**self.steps.train(batch), "lr": 0.1}  # a Python number is fine

    _fit(Good)


def test_a_bug_inside_the_framework_is_not_called_a_user_error():
    """An exception raised in tf-trainer's own code keeps its type and traceback."""
    class CallsTheFrameworkWrongly(toy.ToyTrainer):
        def build_model(self):
            return toy.ToyTrainer.build_model(self)

        def build_train_dataset(self, ctx):
            return self.hooks.call("no_such_hook")

    with pytest.raises(AttributeError, match="no attribute 'no_such_hook'") as raised:
        _fit(CallsTheFrameworkWrongly)
    assert not isinstance(raised.value, UserError)


def test_tfds_data_dir_that_cannot_be_written_is_a_user_error(tmp_path):
    from models import tfds_data

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    config = ml_collections.ConfigDict({"data_dir": str(a_file / "tfds"), "download": True})
    with pytest.raises(tfds_data.DataDirError) as raised:
        tfds_data.load_split("mnist", "train", config)
    assert isinstance(raised.value, UserError)
    assert re.search(rf"TFDS cannot write the data directory {a_file}/tfds to download "
                     rf"'mnist': Not a directory .*--config\.data\.data_dir=DIR",
                     str(raised.value))


# (case id, config file, extra flags, exit status, regex of the last line): a hook
# mistake found at trace time (the five that once ended in "Internal error" or in a
# message not naming the hook are each tested in process above: the command's line is
# "Hook error: " and the HookError's one line, whichever it is), a Keras guide step on 2
# replicas (refused at trace time, not trained N times too fast), and data that is not
# prepared.
COMMAND_CASES = [
    ("StepReturnsTensor", CONFIG,
     ["--config.trainer=tests.checks.hook_mistakes:StepReturnsTensor"], 1,
     r"^Hook error: " + hook_mistakes.CASES["StepReturnsTensor"]),
    ("keras_guide_step_on_2_replicas", CONFIG,
     ["--config.trainer=tests.checks.hook_mistakes:KerasGuideStep",
      "--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"], 1,
     r"^Hook error: " + hook_mistakes.CASES["KerasGuideStep"]),
    *[(f"{name}_on_2_replicas", CONFIG,
       [f"--config.trainer=tests.checks.hook_mistakes:{name}",
        "--config.distribute.strategy=mirrored", "--config.distribute.virtual_devices=2"], 1,
       r"^Hook error: " + regex) for name, regex in hook_mistakes.MULTI_REPLICA_CASES.items()],
    ("mnist_not_prepared", str(REPO / "models" / "configs" / "mnist.py"),
     ["--config.data.data_dir=DATA_DIR"], 1,
     r"^Data error: TFDS dataset 'mnist' is not prepared in .*no_data and "
     r"config\.data\.download is False.*tfds build mnist --data_dir=.*no_data"),
]


@pytest.fixture(scope="module")
def command_runs(tmp_path_factory) -> dict:
    """Every COMMAND_CASES run of ``python -m trainer.main``, started at once."""
    root = tmp_path_factory.mktemp("hook_commands")
    procs = {}
    for case, config, flags, _, _ in COMMAND_CASES:
        flags = [f.replace("DATA_DIR", str(root / "no_data")) for f in flags]
        procs[case] = subprocess.Popen(
            [sys.executable, "-m", "trainer.main", f"--config={config}",
             f"--workdir={root / case}", "--config.train.steps=2", *flags],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    runs = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        runs[case] = (proc.returncode, stdout, stderr)
    return runs


@pytest.mark.parametrize("case, config, flags, status, message", COMMAND_CASES,
                         ids=[c[0] for c in COMMAND_CASES])
def test_trainer_main_ends_a_hook_mistake_in_one_last_line(command_runs, case, config, flags,
                                                          status, message):
    returncode, _, stderr = command_runs[case]
    assert returncode == status, stderr[-3000:]
    assert "Traceback" not in stderr and "Internal error" not in stderr, stderr[-3000:]
    assert re.search(message, last_lines(stderr, 1)), stderr[-3000:]


def test_traceback_flag_shows_the_trace_of_a_hook_mistake(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", f"--config={CONFIG}", f"--workdir={tmp_path}",
         "--config.trainer=tests.checks.hook_mistakes:OneCallback", "--traceback"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert last_lines(proc.stderr, 1).startswith("Hook error: OneCallback.build_callbacks")
