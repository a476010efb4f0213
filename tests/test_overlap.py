"""raycomp._internal.ddp.overlap.BucketThreads driven by hand. Chained: a bucket's decoding waits for its
own collectives and for the bucket issued before it, whatever order the collectives complete
in, and a failure reaches every bucket after it. Threads: the next bucket is sent while the
one before is still on the wire."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from raycomp._internal.ddp.overlap import BucketThreads
from raycomp._internal.transports import Pending

CPU = torch.device("cpu")


class Work:
    """A collective in flight whose completion the test decides."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future


def _bucket(threads: BucketThreads, work: Work, name: str, decoded: list[str]) -> torch.futures.Future:
    def receive(value: str) -> torch.Tensor:
        decoded.append(value)
        return torch.zeros(1)

    return threads.submit(lambda: Pending([work], lambda: name), receive, CPU, inline=False, chain=True)


@pytest.fixture
def threads():
    bucket_threads = BucketThreads(True)
    bucket_threads.new_step()
    yield bucket_threads
    bucket_threads.close()


def _two_buckets(threads: BucketThreads) -> tuple[Work, Work, list[str], list[torch.futures.Future]]:
    first, second = Work(), Work()
    decoded: list[str] = []
    return first, second, decoded, [_bucket(threads, first, "first", decoded),
                                    _bucket(threads, second, "second", decoded)]


def test_a_chained_bucket_decodes_after_the_one_before_it_whatever_completes_first(threads):
    first, second, decoded, results = _two_buckets(threads)
    second.future.set_result(None)  # the later collective completes first
    assert decoded == [] and not results[1].done()
    first.future.set_result(None)
    assert decoded == ["first", "second"]
    assert all(torch.equal(r.wait(), torch.zeros(1)) for r in results)
    threads.new_step()  # a new step's first bucket waits for nothing of the last one
    third = Work()
    result = _bucket(threads, third, "third", decoded)
    third.future.set_result(None)
    assert result.done() and decoded[-1] == "third"


def test_a_failed_collective_fails_its_bucket_and_every_later_one(threads):
    first, second, decoded, results = _two_buckets(threads)
    second.future.set_result(None)
    first.future.set_exception(RuntimeError("gloo: connection closed"))
    for result in results:
        with pytest.raises(RuntimeError, match="connection closed"):
            result.wait()
    assert decoded == []


def test_an_encoding_that_raises_fails_its_bucket_on_the_callers_thread(threads):
    def send() -> Pending[str]:
        raise ValueError("bucket buffer has 3 elements, gradients 4")

    result = threads.submit(send, lambda value: torch.zeros(1), CPU, inline=False, chain=True)
    with pytest.raises(ValueError, match="3 elements"):
        result.wait()


class BlockingWork:
    """A collective that stays on the wire until the test lets it finish."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def wait(self) -> bool:
        return self.finished.wait(10)


def test_with_the_threads_the_next_bucket_is_sent_while_this_one_is_on_the_wire(threads):
    sent: list[str] = []
    on_wire = BlockingWork()

    def send(name: str, works: list) -> Pending[str]:
        sent.append(name)
        return Pending(works, lambda: name)

    results = [threads.submit(lambda: send("first", [on_wire]), lambda value: torch.zeros(1), CPU, inline=False),
               threads.submit(lambda: send("second", []), lambda value: torch.zeros(1), CPU, inline=False)]
    deadline = time.monotonic() + 5
    while sent != ["first", "second"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == ["first", "second"]  # the first still on the wire
    assert not results[0].done()
    on_wire.finished.set()
    assert all(torch.equal(r.wait(), torch.zeros(1)) for r in results)
