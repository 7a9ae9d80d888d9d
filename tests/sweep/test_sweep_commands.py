"""python -m trainer.sweep's bad input, each one line before or after its trial (that its
command line imports no TensorFlow is tests/test_architecture.py's, with the other
command lines)."""

from __future__ import annotations

import subprocess

from tests.sweep.runs import CONFIG, TINY, status, sweep


def one_line(run: subprocess.CompletedProcess) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


def test_mistakes_before_any_trial_are_one_line(tmp_path):
    workdir = f"--workdir={tmp_path / 'sweep'}"
    cases = [
        ((workdir, "--trials=1", "--storage=sqlite:////no/such/dir/study.db"), 1,
         "Storage error: --storage=sqlite:////no/such/dir/study.db cannot be opened: "),
        ((workdir, "--trials=1", "--config.sweep.space=('model.hiden=choice(32, 64)',)"), 1,
         "Configuration error: config.sweep.space: 'model.hiden=choice(32, 64)': "
         "config.model has no field 'hiden'"),
        ((workdir, "--trials=1", "--config.sweep.pruner=median", "--config.eval.every_steps=0"),
         1, "Configuration error: config.sweep.pruner='median' judges the evaluations during "
            "training, but eval.every_steps=0"),
        ((workdir, "--trials=1", "--storage=journal:///no/such/dir/study.log"), 1,
         "Storage error: --storage=journal:///no/such/dir/study.log cannot be opened: "),
        ((workdir,), 2, "Usage error: --trials=N is required"),
        ((workdir, "--trials=2", "--one", "--parallel=2"), 2,
         "Usage error: --one runs a single trial: drop --parallel=2"),
        ((workdir, "--trials=2", "--emit=tfjob"), 2,
         "Usage error: --emit=tfjob: the sweep emits only 'slurm'"),
        ((workdir, "--trials=2", "--workers=0"), 2, "Usage error: --workers=0 must be >= 1"),
        (("--status", workdir), 2, "holds no sweep (no study.db)"),
    ]
    for flags, code, says in cases:
        run = sweep(*flags, config=None if "--status" in flags else CONFIG)
        assert run.returncode == code, (flags, run.stderr[-2000:])
        assert says in one_line(run), flags
    assert not (tmp_path / "sweep" / "trials").exists()


def test_a_metric_the_run_never_reports_fails_its_trial_in_one_line(tmp_path):
    workdir = f"--workdir={tmp_path / 'sweep'}"
    run = sweep(workdir, "--trials=2", "--config.sweep.metric=eval/precision", *TINY)
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Configuration error: config.sweep.metric='eval/precision' is not "
                           "a value the run of trial 0000 reports (it reported: "
                           "eval/accuracy, eval/loss, train/accuracy, train/loss)"), last
    assert status(tmp_path / "sweep")["0000"]["state"] == "FAIL"
    assert "0001" not in status(tmp_path / "sweep")  # the sweep ended there
    # The study remembers what it was started with: another space is refused.
    changed = sweep(workdir, "--trials=2", "--config.sweep.metric=eval/precision",
                    "--config.sweep.space=('model.hidden=choice(8, 16)',)", *TINY)
    assert changed.returncode == 1
    assert "was started with the search space" in one_line(changed)
