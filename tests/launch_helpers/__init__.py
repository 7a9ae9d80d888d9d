"""Test-only helpers for the launcher tests (fake workers, a weights-saving trainer)."""
