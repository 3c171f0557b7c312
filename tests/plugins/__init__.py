"""Plug-ins that extend the workbench from outside arpo_lib (tests/test_plugins.py runs them)."""
