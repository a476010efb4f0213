"""How the DDP hook's buckets are sent and finished beside backward.

Two ways, each keeping bucket order (the same on every rank):

* **chained** (a bucket whose collectives all go out at once, on the CPU): the caller
  (backward, in DDP's hook) encodes the bucket and issues its collectives; its decoding runs
  when they complete, on the thread that completes them, after the previous bucket's, as
  torch's own hooks chain ``then`` on a collective's future. Backward never waits for the
  wire, and no thread of ours takes the cores that backward and gloo share (on a machine
  with fewer cores than ranks that is what the threads cost).
* **threads** (a bucket whose reduction waits for an earlier round before its last, e.g.
  PowerSGD's P before Q; every bucket on CUDA): the sending thread compresses each bucket
  and issues its collectives; the receiving thread waits for them and decodes. So the
  next bucket is compressed while this one is on the wire. One thread each.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from raycomp._internal.transports import Pending

__all__ = ["BucketThreads"]

T = TypeVar("T")


class BucketThreads:
    """The sending and receiving threads of the DDP hook (none when ``enabled`` is False:
    every bucket is then sent, waited for and decoded on the caller's thread)."""

    def __init__(self, enabled: bool) -> None:
        #: the latest chained bucket's result in this step: the next one finishes after it
        self._tail: torch.futures.Future | None = None
        self._sender, self._receiver = (
            (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raycomp-send"),
             concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raycomp-receive"))
            if enabled
            else (None, None)
        )

    @property
    def enabled(self) -> bool:
        return self._sender is not None

    def new_step(self) -> None:
        """A step begins: its first chained bucket waits for no earlier one."""
        self._tail = None

    def submit(self, send: Callable[[], Pending[T]], receive: Callable[[T], torch.Tensor],
               device: torch.device, *, inline: bool, chain: bool = False) -> torch.futures.Future:
        """A future of ``receive(send().wait())``: ``send`` on the sending thread (on the
        caller's if ``inline``), the wait and ``receive`` on the receiving one (all on the
        caller's when the threads are off). ``chain`` (honoured off CUDA, with the threads
        on): ``send`` on the caller's thread and ``receive`` once its collectives and the
        previous chained bucket are done (:meth:`_chained`).

        On CUDA both run on the stream that is current for ``device`` in the caller (DDP
        calls the hook where autograd ordered the bucket's writes), and the future is a
        CUDA future: its result carries an event of that stream, and whoever reads it
        (DDP's copy into ``.grad``, on the stream backward was called on) waits for it.
        With a plain future, a model trained under ``torch.cuda.stream(s)`` had its
        gradients copied before the background thread had decoded them: int4 means off by
        up to 2x on an H100 (docs/gpu.md)."""
        cuda = device.type == "cuda"
        if chain and not cuda and self._sender is not None:
            return self._chained(send, receive)
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

    def _chained(self, send: Callable[[], Pending[T]], receive: Callable[[T], torch.Tensor]) -> torch.futures.Future:
        """``send`` now; ``receive`` of what it finishes with once its collectives and the
        previous chained bucket of the step are done, on the thread that completes the last
        of them (``Pending.finish`` issues no collective, so any thread may run it)."""
        try:
            pending = send()
        except BaseException as error:  # noqa: BLE001 - DDP re-raises it in backward
            failed: torch.futures.Future = torch.futures.Future()
            failed.set_exception(error)
            return failed
        waits = [work.get_future() for work in pending.works]
        if self._tail is not None:
            waits.append(self._tail)

        def finish(done: torch.futures.Future) -> torch.Tensor:
            for each in done.value():
                each.wait()  # raises what a collective, or the bucket before, failed with
            return receive(pending.finish())

        if waits:
            result = torch.futures.collect_all(waits).then(finish)
        else:
            ready: torch.futures.Future = torch.futures.Future()
            ready.set_result([])
            result = ready.then(finish)
        self._tail = result
        return result

    def close(self) -> None:
        for executor in (self._sender, self._receiver):  # the receiver last: the sender feeds it
            if executor is not None:
                executor.shutdown(wait=True)
