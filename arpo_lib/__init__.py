"""ARPO workbench: GRPO plus per-task replay of successful trajectories for UI-TARS GUI agents.

See docs/architecture.md for the packages and what each may import.
"""
from arpo_lib.run.logs import install_default_handler as _install_default_handler

_install_default_handler()
