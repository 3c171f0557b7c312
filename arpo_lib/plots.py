"""Moved to `arpo_lib.viz.plots`; this name stays for notebooks written before the package layout
(`from arpo_lib import plots`)."""
import warnings

from arpo_lib.viz.plots import *  # noqa: F401,F403

warnings.warn("arpo_lib.plots is now arpo_lib.viz.plots", DeprecationWarning, stacklevel=2)
