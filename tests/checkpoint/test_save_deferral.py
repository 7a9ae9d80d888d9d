"""A periodic save due while the previous async write still runs (trainer.checkpoint.deferral)."""

from __future__ import annotations

import itertools

from absl.testing import absltest

from trainer.checkpoint.deferral import SaveDeferral


def in_flight_for(polls: int, step: int = 5):
    """An ``in_flight`` that reports ``step`` for ``polls`` calls, then None."""
    answers = itertools.chain([step] * polls, itertools.repeat(None))
    return lambda: next(answers)


class SaveDeferralTest(absltest.TestCase):

    def test_a_save_with_nothing_in_flight_goes_ahead(self):
        self.assertFalse(SaveDeferral(5, wait_s=0.5).skip(10, lambda: None, "w"))

    def test_a_write_that_finishes_within_the_wait_lets_the_save_go_ahead(self):
        self.assertFalse(SaveDeferral(5, wait_s=30).skip(10, in_flight_for(3), "w"))

    def test_a_stalled_write_skips_the_save_with_one_warning_then_skips_at_once(self):
        deferral, calls = SaveDeferral(5, wait_s=0.2), []

        def stalled():
            calls.append(1)
            return 5

        with self.assertLogs(level="WARNING") as logs:
            self.assertTrue(deferral.skip(10, stalled, "gs://b/run/checkpoints"))
        polled = len(calls)
        self.assertGreater(polled, 1)  # it waited for the write first
        self.assertTrue(deferral.skip(15, stalled, "gs://b/run/checkpoints"))
        self.assertEqual(len(calls), polled + 1)  # the same write: no second wait
        (line,) = logs.output
        self.assertIn("checkpoint of step 10 skipped: the save of step 5 to "
                      "gs://b/run/checkpoints is still being written", line)
        self.assertIn("the next save is at step 15", line)

    def test_the_skip_says_what_the_storage_answers_when_that_is_known(self):
        answers = iter(["the bucket answered 503 (Service Unavailable); its client retries"])
        with self.assertLogs(level="WARNING") as logs:
            self.assertTrue(SaveDeferral(5, wait_s=0.05).skip(
                10, lambda: 5, "gs://b/run/checkpoints", why=lambda: next(answers)))
        (line,) = logs.output
        self.assertIn("after 0 s (slow or unreachable storage: the bucket answered 503 "
                      "(Service Unavailable); its client retries); training goes on", line)

    def test_once_the_write_commits_the_next_save_goes_ahead_and_a_new_stall_warns_again(self):
        deferral = SaveDeferral(5, wait_s=0.05)
        self.assertTrue(deferral.skip(10, lambda: 5, "w"))
        self.assertFalse(deferral.skip(15, lambda: None, "w"))
        with self.assertLogs(level="WARNING"):
            self.assertTrue(deferral.skip(20, lambda: 15, "w"))


if __name__ == "__main__":
    absltest.main()
