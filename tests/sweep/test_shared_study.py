"""Two sweep processes on one study: each trial runs once, the study stops at --trials,
and a trial left to resume is resumed by exactly one of them.

The trial left is the widest race there is: its sweep was killed and its run still
trains (orphaned), so whoever resumes it first stops that run (a SIGTERM, then waiting
for its checkpoint, seconds) before it marks the trial its own; without the claim lock
both sweeps would stop it and resume it."""

from __future__ import annotations

import signal

from tests.sweep.runs import TINY, one_trial_checkpointed, start, starts, status


def test_two_sweeps_share_the_trials_and_resume_the_left_one_once(tmp_path):
    root, _, trial_dir, first = one_trial_checkpointed(tmp_path, "shared", 12000)
    first.send_signal(signal.SIGKILL)  # the sweep; its trial trains on, orphaned
    first.wait(timeout=30)
    assert status(root)["0000"]["state"] == "PREEMPTED"
    flags = (f"--workdir={root}", "--trials=3", *TINY)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    sweeps = [start(*flags, log=log) for log in logs]  # at once, on the same study
    for process, log in zip(sweeps, logs):
        assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    outputs = [log.read_text() for log in logs]
    assert sum(out.count("trial 0000 resumed") for out in outputs) == 1, outputs
    assert {n: (r["state"], r["resumed"]) for n, r in status(root).items()} == {
        "0000": ("COMPLETE", "1"), "0001": ("COMPLETE", "0"), "0002": ("COMPLETE", "0")}
    # Trial 0: its first run and one resume; the others: one run each.
    assert [starts(root / "trials" / f"{n:04d}.log") for n in range(3)] == [2, 1, 1]
