"""Tear-down of every open link when the process ends: an ``atexit`` hook, and SIGTERM/SIGHUP
turned into ``SystemExit`` so that ``with`` blocks unwind (and close their links) normally.

The handlers are installed while a link is open, only from the main thread and only where
the caller has none of its own, and restored once the last link is closed.
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from typing import Any

__all__ = ["forget", "register"]


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # the open ThrottledLinks
_HANDLERS_LOCK = threading.Lock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}


def _close_all() -> None:
    for link in list(_LIVE):
        link.close()


def _on_signal(signum: int, frame: Any) -> None:
    # unwind through the `with` blocks (their __exit__ tears down); atexit is the backstop
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    with _HANDLERS_LOCK:
        if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)
            if previous in (signal.SIG_DFL, None):  # leave a caller's own handler alone
                _PREVIOUS_HANDLERS[sig] = previous
                signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    with _HANDLERS_LOCK:
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in _PREVIOUS_HANDLERS.items():
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
        _PREVIOUS_HANDLERS.clear()


def register(link: Any) -> None:
    """``link`` is open: close it at exit, and on SIGTERM/SIGHUP unwind to its ``with`` block."""
    _LIVE.add(link)
    _install_handlers()


def forget(link: Any) -> None:
    """``link`` is closed; the signal handlers go once no link is open."""
    _LIVE.discard(link)
    _restore_handlers()


atexit.register(_close_all)
