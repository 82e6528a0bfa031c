"""Checks that run in the peers' own virtualenvs (``make peers-test``), never in ``make test``."""
