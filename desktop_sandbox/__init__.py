"""A desktop for a hostile agent without a VM: its own X server, window manager (openbox, or GNOME as
on OSWorld's VM), applications and accessibility bus, confined in user namespaces (or a fresh uid),
with an action server inside that speaks OSWorld's VM server API.

It is a package of its own: it imports nothing of arpo_lib, so an OSWorld user outside this
workbench can run OSWorld's `DesktopEnv` on it (`desktop_sandbox.osworld`, README.md here).

- `sandbox.Sandbox`: one desktop (start, reset, actions, screenshots, files, accessibility tree);
  `SandboxError` when it cannot start or stops answering.
- `confinement`: what the sandbox may see and use (mounts, limits, the two isolation modes).
- `server`: the action server inside (OSWorld's endpoints; agent code only through the check).
- `action_code`: the only agent code the server runs (`check_action_code`).
- `a11y`, `a11y_tree`: the accessibility tree in OSWorld's XML; `gnome`: the GNOME session;
  `usernet`: an optional user-mode network; `windows`: X windows; `bridge`: the host's loopback
  bridge for OSWorld's Chrome DevTools and VLC clients; `osworld`: OSWorld's DesktopEnv on it.

The threat model: THREAT_MODEL.md beside this file.
"""
from typing import Any

__all__ = ["Sandbox", "SandboxError", "desktop_unavailable", "network_mode"]


def __getattr__(name: str) -> Any:
    """The names above, from `sandbox`, imported when first asked for: importing this package (as
    the workbench's action converter does, for `action_code`) starts nothing."""
    if name in __all__:
        from desktop_sandbox import sandbox
        return getattr(sandbox, name)
    raise AttributeError(f"module 'desktop_sandbox' has no attribute {name!r}")
