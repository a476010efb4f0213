"""Two threads that overlap one bucket's encoding with the previous bucket's transfer.

The sending thread compresses each bucket and issues its collectives (in bucket order,
which is the same on every rank); the receiving thread waits for them and decodes. So the
next bucket is compressed while this one is on the wire, and the link is not idle while a
thread encodes. One thread each, so each keeps bucket order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from raycomp.transports import Pending

__all__ = ["BucketThreads"]

T = TypeVar("T")


class BucketThreads:
    """The sending and receiving threads of the DDP hook (none when ``enabled`` is False:
    every bucket is then sent, waited for and decoded on the caller's thread)."""

    def __init__(self, enabled: bool) -> None:
        self._sender, self._receiver = (
            (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raycomp-send"),
             concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raycomp-receive"))
            if enabled
            else (None, None)
        )

    @property
    def enabled(self) -> bool:
        return self._sender is not None

    def submit(self, send: Callable[[], Pending[T]], receive: Callable[[T], torch.Tensor],
               device: torch.device, *, inline: bool) -> torch.futures.Future:
        """A future of ``receive(send().wait())``: ``send`` on the sending thread (on the
        caller's if ``inline``), the wait and ``receive`` on the receiving one (all on the
        caller's when the threads are off).

        On CUDA both run on the stream that is current for ``device`` in the caller (DDP
        calls the hook where autograd ordered the bucket's writes), and the future is a
        CUDA future: its result carries an event of that stream, and whoever reads it
        (DDP's copy into ``.grad``, on the stream backward was called on) waits for it.
        With a plain future, a model trained under ``torch.cuda.stream(s)`` had its
        gradients copied before the background thread had decoded them: int4 means off by
        up to 2x on an H100 (docs/gpu.md)."""
        cuda = device.type == "cuda"
        future: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else None)
        # off CUDA no stream context at all: even torch.cuda.stream(None) initialises CUDA
        # on a machine that has it (a CPU run there, or a forked worker)
        on_stream = functools.partial(torch.cuda.stream, torch.cuda.current_stream(device)) if cuda \
            else contextlib.nullcontext

        def guarded(work: Callable[[], Any], then: Callable[[Any], None]) -> None:
            try:
                with on_stream():
                    then(work())
            except BaseException as error:  # noqa: BLE001 - DDP re-raises it in backward
                future.set_exception(error)

        def finish(pending: Pending[T]) -> None:
            guarded(lambda: receive(pending.wait()), future.set_result)

        def start() -> None:
            if self._receiver is None:
                guarded(send, finish)
            else:
                guarded(send, lambda pending: self._receiver.submit(finish, pending))  # type: ignore[union-attr]

        if inline or self._sender is None:
            start()
        else:
            self._sender.submit(start)
        return future

    def close(self) -> None:
        for executor in (self._sender, self._receiver):  # the receiver last: the sender feeds it
            if executor is not None:
                executor.shutdown(wait=True)
