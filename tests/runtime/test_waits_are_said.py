"""No silent waits: a block that lasts names what it waits for, again and again, and
a short one says nothing (trainer.runtime.waiting, used around every checkpoint commit
and the final flush of the run's records)."""

from __future__ import annotations

import logging
import time

from trainer.runtime.waiting import said_while_waiting


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]


def test_a_long_wait_is_named_every_period_until_it_ends(caplog):
    with caplog.at_level(logging.WARNING):
        with said_while_waiting("the bucket", after_s=0.05, every_s=0.05):
            while len(_notices(caplog)) < 3:  # the block ends after three notices
                time.sleep(0.01)
        said = len(_notices(caplog))
        time.sleep(0.2)
    assert said >= 3 and len(_notices(caplog)) == said  # nothing after the block ended
    assert all(n.startswith("waiting for the bucket (") and n.endswith(" s so far)")
               for n in _notices(caplog)), _notices(caplog)


def test_a_short_wait_says_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        with said_while_waiting("the bucket", after_s=60):
            pass
    assert _notices(caplog) == []
