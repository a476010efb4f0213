"""FSDP2 (``fully_shard``): the compressed reduce-scatter, flat and in two levels, and its state."""
