"""A Jupyter kernel as a user has it (a real ipykernel through jupyter_client): a cell
that builds a Trainer and fits, run again with an edited config; an interrupt
(SIGINT, the kernel's stop button) mid-fit stops it at the next loop, keeps a
checkpoint and leaves the kernel usable; the next cell resumes from that checkpoint.
Progress there is one updating display, not a terminal's control characters."""

from __future__ import annotations

import json
import os
import queue
import time

import pytest
from jupyter_client.manager import start_new_kernel

from tests.conftest import REPO, subprocess_env

SETUP = """
import json, os, pathlib
import trainer
from tests.support import toy

class SayTraining(trainer.Callback):
    '''Touches a file at the first loop end: the test interrupts only then.'''
    def __init__(self, path):
        self.path = pathlib.Path(path)
    def on_loop_end(self, t):
        self.path.touch()

def cell(workdir, callbacks=(), **overrides):
    t = toy.ToyEvalTrainer(toy.toy_config(**{"eval.every_steps": 10, **overrides}),
                           workdir, callbacks=list(callbacks))
    results = t.fit()
    print("RESULT " + json.dumps({"step": t.step, "keys": sorted(results)}))
    return t
"""


class Kernel:
    """One ipykernel process and its client; :meth:`run` executes a cell."""

    def __init__(self):
        env = subprocess_env()
        env["PYTHONPATH"] = str(REPO)
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(REPO),
                                                     env=env, startup_timeout=120)

    def send(self, code: str) -> str:
        return self.client.execute(code)

    def outputs(self, msg_id: str, timeout: float = 240) -> list[dict]:
        """The iopub messages of cell ``msg_id`` until the kernel is idle again."""
        messages, deadline = [], time.monotonic() + timeout
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"no idle after {timeout} s (kernel alive: "
                                     f"{self.manager.is_alive()}); output so far: "
                                     f"{text(messages)[-2000:]}")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return messages
            messages.append(msg)

    def status(self, msg_id: str) -> str:
        """The status of cell ``msg_id``'s execute reply ("ok", "error", "aborted")."""
        while True:
            reply = self.client.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["status"]

    def run(self, code: str, timeout: float = 240) -> tuple[str, list[dict]]:
        """Executes ``code``; (its reply status, its iopub messages)."""
        msg_id = self.send(code)
        messages = self.outputs(msg_id, timeout)
        return self.status(msg_id), messages

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def text(messages: list[dict], name: str | None = None) -> str:
    """The stream text of ``messages`` (``name``: only stdout or stderr)."""
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream"
                   and name in (None, m["content"]["name"]))


def results(messages: list[dict]) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in text(messages, "stdout").splitlines()
            if line.startswith("RESULT ")]


def errors(messages: list[dict]) -> list[dict]:
    return [m["content"] for m in messages if m["msg_type"] == "error"]


def displays(messages: list[dict], kind: str) -> list[tuple[str, str]]:
    """(display id, text/plain) of each ``kind`` message (display_data, update_display_data)."""
    return [(m["content"]["transient"]["display_id"], m["content"]["data"]["text/plain"])
            for m in messages if m["msg_type"] == kind]


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    status, messages = k.run(SETUP)
    assert status == "ok", errors(messages)
    yield k
    k.close()


def test_a_cell_run_again_with_an_edited_config_fits_each_time(kernel, tmp_path):
    for i, lr in enumerate((0.1, 0.05, 0.2)):
        status, messages = kernel.run(
            f"t = cell({str(tmp_path / str(i))!r}, **{{'optimizer.learning_rate': {lr}}})")
        assert status == "ok", errors(messages)
        assert results(messages) == [{"step": 20, "keys": ["eval/accuracy", "eval/loss",
                                                           "train/accuracy", "train/loss"]}]
        assert "retracing" not in text(messages, "stderr")
        # Progress: the window lines as text, the bar as ONE display updated in place
        # (20 steps, 5 per loop: shown after the first loop, updated after the 3 others).
        assert "step 20/20: loss=" in text(messages, "stderr")
        assert "\r" not in text(messages) and "\x1b" not in text(messages)
        [(shown, first)] = displays(messages, "display_data")
        updates = displays(messages, "update_display_data")
        assert first.split()[1] == "5/20"
        assert [display_id for display_id, _ in updates] == [shown] * 3
        assert updates[-1][1].split()[1] == "20/20"


def interrupt_mid_fit(kernel, workdir, marker) -> tuple[str, list[dict]]:
    """Starts a long fit in ``workdir``, interrupts the kernel after its first loop."""
    msg_id = kernel.send(f"t = cell({str(workdir)!r}, [SayTraining({str(marker)!r})], "
                         f"**{{'train.steps': 10**7}})")
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "the long fit never finished a loop"
        time.sleep(0.1)
    kernel.manager.interrupt_kernel()
    messages = kernel.outputs(msg_id, timeout=60)
    return kernel.status(msg_id), messages


def test_an_interrupt_keeps_a_checkpoint_and_the_next_cell_resumes(kernel, tmp_path):
    workdir = tmp_path / "run"
    for attempt in range(2):  # a second interrupt, in a later fit, is a first one again
        marker = tmp_path / f"training-{attempt}"
        status, messages = interrupt_mid_fit(kernel, workdir, marker)
        assert status == "error"
        [error] = errors(messages)
        assert error["ename"] == "Preempted", error
        assert kernel.manager.is_alive()
        steps = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
        assert steps, "no checkpoint kept"
        status, messages = kernel.run(
            f"t = cell({str(workdir)!r}, **{{'train.steps': {steps[-1] + 10}}})")
        assert status == "ok", errors(messages)
        assert f"restored from checkpoint step {steps[-1]}" in text(messages)
        assert results(messages)[0]["step"] == steps[-1] + 10
