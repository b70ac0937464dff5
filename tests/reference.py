"""Moved to tests/support/reference.py; kept until test_engine.py imports it from there."""

from tests.support.reference import StatefulReference

__all__ = ["StatefulReference"]
