"""Specification of ``launch.flags``: a launcher reads a forwarded trainer flag as absl does."""

from launch.flags import flag_value, sets_flag


def test_the_last_occurrence_wins_as_in_absl():
    flags = ["--workdir=/a", "--config=c.py", "--workdir", "/b"]
    assert flag_value(flags, "--workdir") == "/b"
    assert flag_value(["--workdir", "/b", "--workdir=/c"], "--workdir") == "/c"


def test_an_absent_flag_or_one_without_a_value_is_none():
    assert flag_value(["--config=c.py"], "--workdir") is None
    assert flag_value(["--workdir"], "--workdir") is None


def test_a_longer_flag_with_the_same_prefix_is_not_the_flag():
    assert flag_value(["--workdir_extra=/x"], "--workdir") is None
    assert not sets_flag(["--mode_x=1"], "--mode")


def test_sets_flag_sees_every_spelling():
    assert sets_flag(["--mode"], "--mode")
    assert sets_flag(["--mode=eval"], "--mode")
    assert not sets_flag(["--config=c.py"], "--mode")
