"""The DDP comm hook's state: a :class:`~raycomp._internal.reduce.reducer.CompressedReducer`
for a model (:mod:`raycomp._internal.ddp.hook` says how the hook uses it), its parameter
names, the hook's two threads, and DDP's map of unused parameters.

The hook's collectives travel on a process group of their own, created with the state.
DDP issues a collective of its own during backward: with ``find_unused_parameters`` it
all-reduces the map of used parameters right after handing over the last bucket, from its
own thread. On one shared group, the order of that all-reduce and the hook's last
collective is a race between two threads, which two ranks can resolve differently: gloo
then reported a size mismatch, or the run hung.

With ``find_unused_parameters`` DDP also drops the mean of a layer that no rank used at a
step. Error feedback must then keep what it sent for that layer: the hook holds back the
memory update of a lossy layer whose gradient is all zero on this rank, and once backward
has finished, reads DDP's map of used parameters and applies it as sent (some rank used
the layer) or as nothing sent (no rank did).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raycomp._internal.ddp.overlap import BucketThreads
from raycomp._internal.ddp.plain_step import PlainStep
from raycomp._internal.ddp.torch_ddp import hook_group, reducer_order, refuse_sparse_gradients
from raycomp._internal.node_link import node_seconds_per_byte
from raycomp._internal.reduce.loss_scale import check_scaler
from raycomp._internal.reduce.memory import Memory
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.two_level import INTRA, TwoLevelReducer
from raycomp._internal.topology import Topology, node_groups
from raycomp._internal.transports import Pending
from raycomp._internal.wire.ledger import WireLedger
from raycomp.compressors import Transport
from raycomp.plan import Plan

__all__ = ["CompressionState"]

T = TypeVar("T")


class CompressionState:
    """A :class:`CompressedReducer` for a model: parameter names, the hook's threads, and
    DDP's map of unused parameters.

    Args:
        model: the model (DDP-wrapped or not); parameter names come from
            ``named_parameters()`` with DDP's ``module.`` prefix removed.
        plan: initial plan (default: everything dense); change it with ``set_plan``.
        async_comm: reduce buckets in the background (DDP hook only), so backward
            computes the next buckets while this one communicates, and the next bucket is
            compressed while this one is on the wire. Turn it off to debug a hook step by
            step; it costs that overlap.
        process_group: the group the hook reduces over. ``None`` (the default) creates a
            group of the state's own over all ranks (``dist.new_group``, so every rank
            must build its state at the same point, as it builds DDP): DDP's group is busy
            with DDP's own collectives during backward (see the module docstring). A group
            you pass must span DDP's ranks and, with ``find_unused_parameters``, must not
            be DDP's own.
        grad_scaler: your ``torch.amp.GradScaler`` when you train in fp16 with loss
            scaling: the gradients the hook sees are scaled, and error feedback must follow
            the scale as it changes (``raycomp._internal.reduce.loss_scale``). Not needed for bf16.
        topology: this rank's place, node and local rank (``raycomp._internal.topology.discover()``
            finds it from Ray Train or torchrun). With several nodes of several ranks each,
            compressed steps reduce in two levels (:mod:`raycomp._internal.reduce.two_level`): dense inside
            the node, and only each node's mean crosses nodes, compressed, cut into one piece
            per rank of the node, so a node's slow link carries what one flat rank would.
            Every rank passes its own (the state gathers them to build the groups). ``None``
            (the default) or one level: every rank is its own node, as before. A dense plan's
            plain step stays one flat all-reduce either way.
        memory, min_compress_numel, seed, stats_every, profile_ratios: as
            in :class:`CompressedReducer`. In short: ``memory="residual"`` is error
            feedback, which every biased compressor needs to keep dense accuracy;
            ``min_compress_numel`` keeps small layers (biases, norms) dense, where the
            extra collective round costs more than their bytes.
    """

    def __init__(
        self, model: torch.nn.Module, plan: Plan | None = None, *, async_comm: bool = True,
        process_group: Any = None, memory: str | Memory = "residual", min_compress_numel: int = 1024,
        seed: int = 0, stats_every: int = 0, profile_ratios: tuple[float, ...] = (),
        grad_scaler: torch.amp.GradScaler | None = None, topology: Topology | None = None,
    ) -> None:
        refuse_sparse_gradients(model)  # before the group: nothing to undo
        check_scaler(grad_scaler)
        group = hook_group(model, process_group)
        levels = node_groups(topology) if topology is not None else None
        options = dict(process_group=group, memory=memory, min_compress_numel=min_compress_numel, seed=seed,
                       stats_every=stats_every, profile_ratios=profile_ratios, grad_scaler=grad_scaler)
        self.reducer = CompressedReducer(plan, **options) if levels is None else \
            TwoLevelReducer(levels, plan, **options)
        module = getattr(model, "module", model)
        #: seconds the steps waited for their reductions (the adaptive policy's "comm"): a
        #: reduction run inline is waited for whole; with the background thread, only what is
        #: left when backward hands over the last bucket. Time a reduction spends beside
        #: backward is hidden and not counted: counted, it made the policy measure a fast
        #: link at a fraction of its effective rate
        self.comm_seconds = 0.0
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
        self._threads = BucketThreads(async_comm)
        self._send_inline = not self._threads.enabled  # this step's: see begin_step
        self._plain = False  # this step is a plain step, reduced in the hook (begin_step)
        # DDP with find_unused_parameters drops the mean of a layer no rank used, after the
        # hook: such a layer's memory update waits until DDP's map of used parameters is in
        self._ddp_reducer = getattr(model, "reducer", None) if getattr(model, "find_unused_parameters", False) \
            else None
        self.reducer.defer_unused = self._ddp_reducer is not None
        self._map_index = {self._names[id(p)]: i for i, p in enumerate(reducer_order(model))} \
            if self.defer_unused else {}
        #: what DDP's buckets hold, each layer once: what a plain step reduces and counts
        #: (a state built on the module inside the DDP: its trainable parameters)
        bucketed = reducer_order(model) if isinstance(model, DistributedDataParallel) else self.parameters
        self.plain = PlainStep(self.reducer, [(self._names[id(p)], p) for p in bucketed], self.name_of,
                               self._end_step_waited)
        #: (plan, whether it is dense everywhere, whether its buckets go out at once)
        self._plan_shape_of: tuple[Plan, bool, bool] | None = None
        self._chain = False  # this step's compressed buckets are chained (begin_step)
        #: reduce each bucket inside the node only, dense (local steps between nodes: a node
        #: is one replica; :mod:`raycomp._internal.train.local_strategy`)
        self.inside_node = False

    # --- the reducer's face: what the training loop reads and calls --------------------
    plan = property(lambda self: self.reducer.plan)
    step = property(lambda self: self.reducer.step)
    stats = property(lambda self: self.reducer.stats)
    stats_step = property(lambda self: self.reducer.stats_step)
    mean_samples = property(lambda self: self.reducer.mean_samples)
    stats_plan = property(lambda self: self.reducer.stats_plan)
    #: the guard judges the applied mean's error at agreements (raycomp._internal.reduce.mean_error), not
    #: each rank's own error in the step's rows
    measures_mean_error = True
    ledger: WireLedger = property(lambda self: self.reducer.ledger)  # type: ignore[assignment]
    memory: Memory = property(lambda self: self.reducer.memory)  # type: ignore[assignment]
    local_nonfinite = property(lambda self: self.reducer.local_nonfinite)
    #: this step left skippable control values out (raycomp._internal.reduce.signals.StepSignals.drop)
    control_skipped = property(lambda self: self.reducer.control_skipped)
    #: the node's group and this rank's cross-node group when compressed steps reduce in two
    #: levels (raycomp._internal.reduce.two_level), else None
    levels = property(lambda self: self.reducer.levels if isinstance(self.reducer, TwoLevelReducer) else None)
    #: the ranks of a node in two levels, else 1
    per_node = property(lambda self: self.levels.intra.size if self.levels else 1)
    #: this rank's place in the reduction: its local rank in two levels (the ranks of one
    #: position reduce the same pieces across nodes), else 0
    position = property(lambda self: self.levels.intra.rank if self.levels else 0)
    defer_unused = property(lambda self: self.reducer.defer_unused)
    #: bytes sent inside the node so far (two levels), 0 when flat
    intra_bytes = property(lambda self: self.reducer.intra_ledger.wire_total if self.levels else 0.0)

    @property
    def control_rows(self) -> torch.Tensor | None:
        return self.reducer.control_rows

    @control_rows.setter
    def control_rows(self, rows: torch.Tensor | None) -> None:
        self.reducer.control_rows = rows

    def set_plan(self, plan: Plan) -> None:
        self.reducer.set_plan(plan)

    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        self.reducer.stage_control(values, skippable)

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        return self.reducer.gradient_norm(parameters)

    def discard_step(self) -> None:
        self.reducer.discard_step()

    def start(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
              closes_step: bool = False, overwrite: bool = False) -> Pending[list[torch.Tensor]]:
        return self.reducer.start(names, grads, closes_step=closes_step, overwrite=overwrite)

    def end_step(self) -> None:
        self.reducer.end_step()

    def _end_step_waited(self, since: float) -> None:
        """End the step; the time since ``since`` is what the step waited for its reduction."""
        self.end_step()
        self.comm_seconds += time.perf_counter() - since

    def time_node_link(self) -> float | None:
        """Seconds per byte of an all-reduce inside this rank's node, as the model's
        gradients would travel it (:func:`raycomp._internal.node_link.node_seconds_per_byte`); None
        when the run is flat. Collective: every rank calls it at the same point."""
        if self.levels is None or not self.parameters:
            return None
        first = self.parameters[0]
        return node_seconds_per_byte(self.levels, sum(p.numel() * p.element_size() for p in self.parameters),
                                     first.device, first.dtype)

    def state_dict(self) -> dict[str, Any]:
        return self.reducer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reducer.load_state_dict(state)

    # --- the hook's own work -----------------------------------------------------------
    def name_of(self, parameter: torch.Tensor) -> str:
        try:
            return self._names[id(parameter)]
        except KeyError:
            raise ValueError(
                "a gradient bucket holds a parameter that is not in the model given to "
                "CompressionState; build the state from the same model that DDP wraps"
            ) from None

    def reduce_inside_node(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The node's mean of a bucket (a dense all-reduce over the node's group, as torch's
        all-reduce hook runs it), counted in the intra-node ledger; no step of the reducer."""
        if self.levels is None:
            raise RuntimeError("CompressionState.inside_node needs two levels (a topology of several "
                               "nodes of several ranks)")
        intra = self.levels.intra
        buffer.div_(intra.size)
        work = dist.all_reduce(buffer, group=intra.handle, async_op=True)
        self.reducer.intra_ledger.add(INTRA, intra.allreduce_bytes(buffer.numel() * buffer.element_size()))
        return work.get_future().then(lambda fut: fut.value()[0])

    def allreduce_gradients(self) -> None:
        """Replace every parameter's ``.grad`` by its compressed mean across ranks."""
        started = time.perf_counter()
        params = [p for p in self.parameters if p.grad is not None]
        means = self.reducer.reduce([self.name_of(p) for p in params], [p.grad for p in params], closes_step=True)
        for p, mean in zip(params, means, strict=True):
            p.grad.copy_(mean)
        self._end_step_waited(started)

    def begin_step(self) -> None:
        """Begin the reducer's step; a step that opens here also decides where its
        collectives are issued. A dense step (a plan that sends every layer dense) has
        nothing to encode, so the sending thread would only add a thread hand-off a bucket,
        on the core that backward and gloo already share, which a dense plan on a fast
        link pays every step.
        The decision holds for the whole step and depends only on the plan, which every
        rank installs at the same step: every rank issues from the same thread."""
        if self.reducer.in_step:
            return
        self.reducer.begin_step()
        self.plain.begin_step()
        self._threads.new_step()
        dense, single = self._plan_shape()
        self._send_inline = not self._threads.enabled or dense
        self._plain = dense and self._threads.enabled and self.plain.ready()
        # every collective of a bucket issued at once: backward issues them and the decoding
        # follows their completion (raycomp._internal.ddp.overlap, chained); else the two threads
        self._chain = single and not dense

    def _dense_everywhere(self) -> bool:
        return self._plan_shape()[0]

    def _plan_shape(self) -> tuple[bool, bool]:
        """(every layer dense, every layer's collectives issued at once) under the plan in
        force: the same on every rank. A flat reducer's dense all-reduce, casts' and
        shared-index sums, sparse all-gathers and, at two ranks, the scalable route's one
        all-gather go out at once; PowerSGD's Q waits for P, the scalable route past two
        ranks for its exchange, and a two-level step for its node's hop."""
        if self._plan_shape_of is None or self._plan_shape_of[0] is not self.plan:
            kinds = {self.reducer.transport_for(self.name_of(p), p.shape) for p in self.parameters}
            at_once = {Transport.DENSE, Transport.ALLREDUCE, Transport.ALLGATHER}
            if self.reducer.send_group.size <= 2:
                at_once.add(Transport.SCALABLE)
            single = self.levels is None and kinds <= at_once
            self._plan_shape_of = (self.plan, kinds <= {Transport.DENSE}, single)
        return self._plan_shape_of[1], self._plan_shape_of[2]

    def plain_in_hook(self) -> bool:
        """Whether this step is a plain step reduced in the hook, its buckets
        all-reduced where they lie (:meth:`raycomp._internal.ddp.plain_step.PlainStep.reduce_bucket`):
        every layer dense, nothing held in error feedback, no Top-K error profile measured.
        Its collectives are issued on the caller's thread and stream, as torch's all-reduce
        hook issues them, and their futures carry that stream's events on CUDA: the threads
        and the general path would cost a dense step of a small model (on a GPU most of
        all). Decided when the step begins, the same on every rank."""
        self.begin_step()
        return self._plain

    def next_step_plain(self) -> bool:
        """Whether the next step will be a plain step (:mod:`raycomp._internal.ddp.plain_step`), asked
        before it begins, while no step is open (before the step's forward): from the plan in
        force, the step's number and what error feedback holds, which every rank holds alike."""
        return (not self.reducer.in_step and self._threads.enabled and self._dense_everywhere()
                and self.plain.ready())

    @property
    def overlaps(self) -> bool:
        """Whether the hook reduces buckets on its background threads, beside backward."""
        return self._threads.enabled

    def submit(self, send: Callable[[], Pending[T]], receive: Callable[[T], torch.Tensor],
               device: torch.device) -> torch.futures.Future:
        """A future of ``receive(send().wait())``, begun in this step: ``send`` on the
        sending thread (on the caller's in a step that :meth:`begin_step` found dense
        everywhere), the wait and ``receive`` on the receiving one; in a step whose buckets'
        collectives all go out at once, ``send`` on the caller's thread and ``receive``
        chained on their completion (:meth:`raycomp._internal.ddp.overlap.BucketThreads.submit`)."""
        self.begin_step()
        return self._threads.submit(send, receive, device, inline=self._send_inline, chain=self._chain)

    def settle_after_backward(self) -> None:
        """Queue :meth:`CompressedReducer.settle_unused` to run once DDP has finished this
        backward: its map of used parameters is all-reduced after the last bucket and read
        under DDP's lock, which the hook runs inside. A callback queued by a callback runs
        after DDP's own."""
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def settle() -> None:
            if self.reducer.holding_back:  # a layer idle here: DDP waited for the map to decide on it
                counts = self._ddp_reducer._get_local_used_map().tolist()  # type: ignore[union-attr]
                self.reducer.settle_unused(lambda name: counts[self._map_index[name]] > 0)

        try:
            engine.queue_callback(lambda: engine.queue_callback(settle))
        except RuntimeError:  # not in a backward: DDP's join shadows a step of a joined rank
            pass  # begin_step settles them as used

    def close(self) -> None:
        self._threads.close()

    def __enter__(self) -> CompressionState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("CompressionState holds threads and a process group; save state_dict() instead")
