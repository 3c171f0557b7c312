"""The desktop's top-level windows, through the window manager's EWMH hints (python-xlib).

OSWorld's set-up steps `activate_window` and `close_window` and its `/window_size` getter name a
window by its title or its WM_CLASS. Its VM does this with `wmctrl`; these functions follow
wmctrl's matching rules (written from its documentation) so the task files mean the same here:

- by title (default) or by WM_CLASS `instance.Class` (`by_class`);
- a case-insensitive substring, or the exact, case-sensitive string (`strict`);
- the first match in the window manager's client list (oldest first) is the one acted on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Window:
    id: int
    title: str
    wm_class: str
    """`instance.Class`, as `wmctrl -lx` prints it."""
    x: int
    y: int
    width: int
    height: int


def _open(display: str) -> Any:
    from Xlib import display as xdisplay

    return xdisplay.Display(display)


def _text(connection: Any, window: Any, name: str, kind: str) -> str | None:
    atom = connection.intern_atom(name)
    prop = window.get_full_property(atom, connection.intern_atom(kind) if kind != "ANY" else 0)
    if prop is None:
        return None
    value = prop.value
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def list_windows(display: str) -> list[Window]:
    """Every managed top-level window, in the window manager's order (oldest first)."""
    from Xlib import X, error

    connection = _open(display)
    try:
        root = connection.screen().root
        clients = root.get_full_property(connection.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
        out = []
        for wid in (clients.value if clients is not None else []):
            window = connection.create_resource_object("window", int(wid))
            try:
                title = _text(connection, window, "_NET_WM_NAME", "UTF8_STRING")
                if title is None:
                    title = _text(connection, window, "WM_NAME", "ANY") or ""
                wm_class = window.get_wm_class() or ("", "")
                geometry = window.get_geometry()
                origin = window.translate_coords(root, 0, 0)
                out.append(Window(int(wid), title, ".".join(wm_class), -origin.x, -origin.y,
                                  geometry.width, geometry.height))
            except error.XError:  # closed while being listed
                continue
        return out
    finally:
        connection.close()


def find(windows: list[Window], name: str, *, strict: bool = False, by_class: bool = False) -> list[Window]:
    """The windows `name` designates under wmctrl's rules (see the module's docstring)."""
    def key(w: Window) -> str:
        return w.wm_class if by_class else w.title

    if strict:
        return [w for w in windows if key(w) == name]
    lowered = name.lower()
    return [w for w in windows if lowered in key(w).lower()]


def _client_message(display: str, window_id: int, message: str, data: list[int]) -> None:
    from Xlib import X
    from Xlib.protocol import event

    connection = _open(display)
    try:
        root = connection.screen().root
        window = connection.create_resource_object("window", window_id)
        payload = (data + [0] * 5)[:5]
        ev = event.ClientMessage(window=window, client_type=connection.intern_atom(message),
                                 data=(32, payload))
        root.send_event(ev, event_mask=X.SubstructureRedirectMask | X.SubstructureNotifyMask)
        connection.sync()
    finally:
        connection.close()


def activate(display: str, window: Window) -> None:
    """Raise and focus the window (EWMH _NET_ACTIVE_WINDOW, from a pager: source 2, as wmctrl)."""
    _client_message(display, window.id, "_NET_ACTIVE_WINDOW", [2, 0, 0])


def close(display: str, window: Window) -> None:
    """Ask the window to close (EWMH _NET_CLOSE_WINDOW: the application may still ask to save)."""
    _client_message(display, window.id, "_NET_CLOSE_WINDOW", [0, 2])


def active_window_id(display: str) -> int | None:
    from Xlib import X

    connection = _open(display)
    try:
        prop = connection.screen().root.get_full_property(connection.intern_atom("_NET_ACTIVE_WINDOW"),
                                                          X.AnyPropertyType)
        return int(prop.value[0]) if prop is not None and len(prop.value) and prop.value[0] else None
    finally:
        connection.close()


def cursor_position(display: str) -> tuple[int, int]:
    connection = _open(display)
    try:
        pointer = connection.screen().root.query_pointer()
        return int(pointer.root_x), int(pointer.root_y)
    finally:
        connection.close()
