"""The pytest plugin: ``pytest_plugins = ["amesh.testing.pytest_plugin"]``."""

from __future__ import annotations

from ._pytest import amesh_no_leaks, amesh_settings, pytest_configure, pytest_unconfigure

__all__ = ["amesh_no_leaks", "amesh_settings", "pytest_configure", "pytest_unconfigure"]
