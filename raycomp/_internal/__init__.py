"""raycomp's internals: what runs inside a worker behind the public API.

The public API is :mod:`raycomp` (the hook API), :mod:`raycomp.train`, :mod:`raycomp.compressors`,
:mod:`raycomp.config`, :mod:`raycomp.integrations` and :mod:`raycomp.controllers`. Everything
under ``raycomp._internal`` may change between releases; ``jobs/`` imports the internal modules
that docs/architecture.md lists as documented internals.

``ddp/``      the DDP communication hook and how a step's buckets travel
``fsdp/``     FSDP2's compressed reduce-scatter, flat and in two levels
``reduce/``   the compressed mean every path shares: routing, error feedback, statistics
``wire/``     what travels: payloads and their exact bytes, bit packing, control rows, the ledger
``transports/`` how a payload travels: one collective scheme per module
``local/``    local steps: inner steps, the pseudo-gradient, the outer optimizer
``observe/``  the metric catalogue, the dashboard, ``raycomp inspect`` / ``plot``
``train/``    what :mod:`raycomp.train` runs: the step loop, plan agreement, checkpoints, resize
"""
