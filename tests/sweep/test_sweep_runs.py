"""Real sweeps of the digits demo: two trials at a time, each an ordinary trainer.main run
its printed command reproduces; a trial preempted by a real SIGTERM, and a sweep killed
mid-trial, resume the trial from its checkpoint when the sweep runs again."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess

from tests.sweep.runs import (TINY, one_trial_checkpointed, start, status, sweep, trial_pid,
                              wait_for)
from tests.support.helpers import REPO, subprocess_env


def test_two_trials_at_a_time_each_an_ordinary_run_its_command_reproduces(tmp_path):
    root = tmp_path / "digits"
    run = sweep(f"--workdir={root}", "--trials=2", "--parallel=2", *TINY)
    assert run.returncode == 0, run.stderr[-3000:]
    events = [line for line in run.stderr.splitlines() if line.startswith("trial ")]
    assert [e.split()[2] for e in events[:2]] == ["started:", "started:"], events  # both at once
    rows = status(root)
    assert sorted(rows) == ["0000", "0001"]
    for row in rows.values():
        assert (row["state"], row["step"], row["resumed"]) == ("COMPLETE", "100", "0")
        assert {"optimizer.learning_rate", "model.hidden", "train.global_batch_size",
                "eval/accuracy"} <= set(row)
    best = json.loads((root / "best_config.json").read_text())
    accuracy = {n: float(r["eval/accuracy"]) for n, r in rows.items()}
    assert f"{best['trial']:04d}" == max(accuracy, key=accuracy.get)
    assert best["config"]["model"]["hidden"] == best["overrides"]["model.hidden"]
    assert best["config"]["optimizer"]["learning_rate"] == best["overrides"]["optimizer.learning_rate"]
    assert best["command"] in run.stderr  # printed when the trial started
    # The command alone, in a fresh workdir, trains the same run to the same value.
    trial_dir = f"--workdir={best['workdir']}"
    argv = [a if a != trial_dir else f"--workdir={tmp_path / 'alone'}"
            for a in shlex.split(best["command"])]
    alone = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True,
                           text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    final = json.loads(alone.stderr.split("final: ", 1)[1].splitlines()[0])
    assert final["eval/accuracy"] == best["value"]


def test_a_trial_sigtermed_mid_run_resumes_from_its_checkpoint_and_counts_once(tmp_path):
    root, flags, trial_dir, first = one_trial_checkpointed(tmp_path, "preempted", 4000)
    os.kill(wait_for(lambda: trial_pid(trial_dir)), signal.SIGTERM)  # the trial, not the sweep
    assert first.wait(timeout=120) == 143, (tmp_path / "first.log").read_text()[-3000:]
    assert "trial 0000 preempted at step" in (tmp_path / "first.log").read_text()
    stopped = status(root)["0000"]
    assert stopped["state"] == "PREEMPTED" and int(stopped["step"]) < 4000
    again = sweep(*flags)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trial 0000 resumed (resume #1)" in again.stderr
    records = [json.loads(line) for line in (trial_dir / "metrics.jsonl").open()]
    restored = [r["step"] for r in records if r["kind"] == "restore"]
    assert restored and restored[0] >= 500  # resumed from its checkpoint, not step 0
    assert f"resumed from step {restored[0]}" in (root / "trials" / "0000.log").read_text()
    assert {"0000": ("COMPLETE", "4000", "1")} == {
        n: (r["state"], r["step"], r["resumed"]) for n, r in status(root).items()}


def test_a_killed_sweep_leaves_no_trial_running_forever(tmp_path):
    root, flags, trial_dir, first = one_trial_checkpointed(tmp_path, "killed", 12000)
    first.send_signal(signal.SIGKILL)  # the sweep itself; its trial runs on, orphaned
    first.wait(timeout=30)
    orphan = trial_pid(trial_dir)
    # Held (SIGSTOP) until the new sweep has sent its SIGTERM, so it cannot end its
    # training first on a loaded machine; SIGCONT delivers the SIGTERM.
    os.kill(orphan, signal.SIGSTOP)
    assert status(root)["0000"]["state"] == "PREEMPTED"  # its sweep is gone
    log = tmp_path / "again.log"
    again = start(*flags, log=log)
    wait_for(lambda: "outlived its sweep; stopping it to resume it" in log.read_text())
    os.kill(orphan, signal.SIGCONT)
    assert again.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert trial_pid(trial_dir) is None
    assert {"0000": ("COMPLETE", "12000", "1")} == {
        n: (r["state"], r["step"], r["resumed"]) for n, r in status(root).items()}
