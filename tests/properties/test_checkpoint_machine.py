"""A model-based test of the checkpoint service (hypothesis state machine).

The real :class:`trainer.checkpoint.service.Checkpointer` (and the stop's save,
:class:`trainer.checkpoint.stop_save.StopSave`) over a real orbax store on a local disk,
driven through their hooks as the loop driver drives them: loops that end on
save steps, a store that turns slow (async writes stay in flight until waited for: a
bucket at 300 ms per request, so a due save is deferred), a write that fails (a full
disk), a committed step corrupted on disk, stops (a preemption's save in
``on_train_end``) and restarts (a new service; the latest good checkpoint restored).
The weights of step ``s`` hold the value ``s``, so what is read back names its step.

Invariants:

* a stop's save always writes its step (whether the periodic save of that step was
  deferred, failed or is still in flight, or an earlier copy of it is corrupt) unless
  the storage fails at the stop, and then it reports nothing saved; what it reports
  saved is committed and verifies;
* every step announced to callbacks (``on_checkpoint``) is committed and verifies
  once the service's writes are (unless corrupted by the test after that);
* a restart restores the newest checkpoint that verifies, whatever was skipped,
  failed or corrupted before;
* a step whose copy on disk is corrupt is replaced when it is saved again;
* a ``StorageError`` comes only from a write the machine made fail (its cause is the
  error the store injected), never from anything else.
"""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.properties import profiles
from tests.support import toy
from tests.support.checkpoint_service import HeldStore, ServiceRun, set_step, weights_of
from trainer.checkpoint import inventory, resume
from trainer.checkpoint.deferral import SaveDeferral
from trainer.checkpoint.service import Checkpointer
from trainer.checkpoint.stop_save import StopSave
from trainer.checkpoint.state import CheckpointError
from trainer.checkpoint.storage.reader import LATEST_DIR
from trainer.errors import StorageError
from trainer.run_context import RunEvents

EVERY = 2  # checkpoint.every_steps; each loop of the machine ends on a save step
TOTAL = 40


@pytest.fixture(scope="module")
def toy_trainer(tmp_path_factory):
    trainer = toy.ToyTrainer(toy.toy_config(**{
        "train.steps": TOTAL, "checkpoint.every_steps": EVERY,
        "checkpoint.max_to_keep": 1000}), str(tmp_path_factory.mktemp("unused")))
    trainer.context.ensure_built()
    return trainer


def test_the_checkpoint_service_never_reports_what_did_not_happen(toy_trainer, tmp_path_factory):

    class CheckpointMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.workdir = str(tmp_path_factory.mktemp("machine"))
            self.trainer = toy_trainer
            self.last_event: dict[int, str] = {}  # step -> "announced" | "corrupted"
            set_step(self.trainer, 0)
            self.start()

        def start(self) -> None:
            cfg = self.trainer.config
            self.store = HeldStore(self.workdir, cfg.checkpoint, "")
            self.service = Checkpointer(cfg, self.workdir, True, writer=self.store,
                                        deferral=SaveDeferral(EVERY, wait_s=0))
            self.events = RunEvents()
            self.stop_save = StopSave(self.service, cfg, self.events)
            self.run = ServiceRun(self.trainer, self.workdir)
            self.service.on_fit_start(self.run)

        def reported(self) -> list[tuple[int | None, str]]:
            """What the stop's saves reported (``saved``, ``last_good``), once each."""
            reports = [(r["saved"], r["last_good"]) for r in self.events.records
                       if r["kind"] == "preemption"]
            self.events.records.clear()
            return reports

        def committed(self) -> dict[int, str]:
            return {e.step: e.state for e in inventory.survey(self.workdir)
                    if os.path.basename(os.path.dirname(e.path)) == LATEST_DIR}

        def end_fit(self) -> None:
            try:
                self.service.on_fit_end(self.run, {})
            except StorageError as error:  # only from a write this machine made fail
                assert self.store.caused(error), error
            self.last_event.update((step, "announced") for step in self.run.announced)
            states = self.committed()
            for step, event in self.last_event.items():
                if event == "announced":  # saved (again) since it was last corrupted
                    assert states.get(step) == inventory.COMPLETE, (step, states)

        @precondition(lambda self: self.trainer.step + EVERY <= TOTAL)
        @rule(loops=st.integers(1, 3))
        def train(self, loops):
            for _ in range(loops):
                if self.trainer.step + EVERY > TOTAL:
                    return
                set_step(self.trainer, self.trainer.step + EVERY)
                try:
                    self.service.on_loop_end(self.run)
                except StorageError as error:  # two failed saves in a row: the run stops
                    assert self.store.caused(error), error
                    self.end_fit()
                    self.restart()
                    return

        @rule(slow=st.booleans())
        def storage_speed(self, slow):
            self.store.slow = slow

        @rule()
        def a_write_fails(self):
            self.store.fail_next = True

        @rule(data=st.data())
        def corrupt_a_committed_step(self, data):
            self.service.wait()  # (what is committed no longer depends on timing)
            steps = sorted(s for s, state in self.committed().items()
                           if state == inventory.COMPLETE)
            if not steps:
                return
            step = data.draw(st.sampled_from(steps))
            state_dir = os.path.join(self.workdir, LATEST_DIR, str(step), "state")
            files = sorted((os.path.getsize(os.path.join(r, n)), os.path.join(r, n))
                           for r, _, names in os.walk(state_dir) for n in names
                           if n != "crc32c.json")
            with open(files[-1][1], "r+b") as f:
                f.truncate(files[-1][0] // 2)
            self.last_event.update((s, "announced") for s in self.run.announced)
            self.run.announced.clear()
            self.last_event[step] = "corrupted"

        @precondition(lambda self: 0 < self.trainer.step < TOTAL)
        @rule()
        def preempt(self):
            step = self.trainer.step
            self.run.stopped_by = "preemption"
            try:
                self.service.on_train_end(self.run)
                self.stop_save.on_train_end(self.run)
            except StorageError as error:
                assert self.store.caused(error), error
                assert not self.reported()  # a failed stop save reports nothing saved
            else:  # no storage fault: the stop's step is saved, whatever came before
                (saved, last_good), = self.reported()
                assert saved == step, (saved, last_good)
                assert self.committed().get(step) == inventory.COMPLETE, self.committed()
                assert f"step {step} " in last_good
            self.end_fit()
            self.restart()

        def restart(self) -> None:
            """A new process: a new service, the latest good checkpoint restored."""
            good = [s for s, state in self.committed().items() if state == inventory.COMPLETE]
            set_step(self.trainer, -1)
            self.start()
            if not good and self.committed():  # all corrupt: refused, the user deletes them
                with pytest.raises(CheckpointError, match="No readable checkpoint"):
                    resume.restore(self.run)
                shutil.rmtree(os.path.join(self.workdir, LATEST_DIR))
                self.start()
            restored = resume.restore(self.run)
            if not good:
                assert restored is None
                set_step(self.trainer, 0)
                return
            assert restored == max(good)
            assert weights_of(self.trainer) == float(restored)

        @invariant()
        def step_in_range(self):
            assert 0 <= self.trainer.step <= TOTAL

        def teardown(self):
            self.store.slow = False
            self.end_fit()

    CheckpointMachine.TestCase.settings = settings(
        max_examples=profiles.examples(20), stateful_step_count=12)
    CheckpointMachine.TestCase().runTest()
