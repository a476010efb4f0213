"""The DDP communication hook (:func:`raycomp.compression_hook`) and how a step's buckets travel beside backward."""
