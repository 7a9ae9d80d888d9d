"""Where a sweep's trials run and where its study lives: trials that are local worker
groups (``--workers``), two at once, in Optuna's journal file (``journal:///PATH``)."""

from __future__ import annotations

import re

from tests.sweep.runs import TINY, starts, status, sweep


def test_two_worker_group_trials_at_once_in_a_journal_file(tmp_path):
    root = tmp_path / "groups"
    journal = tmp_path / "study.log"
    run = sweep(f"--workdir={root}", "--trials=2", "--parallel=2", "--workers=2",
                f"--storage=journal://{journal}", *TINY)
    assert run.returncode == 0, run.stderr[-3000:]
    table = status(root, f"--storage=journal://{journal}")
    assert {n: (r["state"], r["step"]) for n, r in table.items()} == {
        "0000": ("COMPLETE", "100"), "0001": ("COMPLETE", "100")}
    assert journal.stat().st_size > 0 and not (root / "study.db").exists()
    ports = []
    for number in ("0000", "0001"):
        log = (root / "trials" / f"{number}.log").read_text()
        assert starts(root / "trials" / f"{number}.log") == 1
        assert "-m launch.multiworker --workers=2 --" in log.splitlines()[0]
        started = re.findall(r"\[launcher\] starting 2 task\(s\) on 127\.0\.0\.1: "
                             r"worker:0=(\d+), worker:1=(\d+)", log)
        assert len(started) == 1, log[-3000:]
        ports += started[0]
        assert "[worker:1] " in log  # both tasks trained
    assert len(set(ports)) == 4, ports  # each group on its own ports

