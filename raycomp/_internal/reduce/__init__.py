"""The compressed mean of gradients that DDP, FSDP and local steps share: routing, error feedback,
the two-level split, and the statistics measured on the way."""
