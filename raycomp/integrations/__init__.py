"""raycomp inside training frameworks that run on Ray Train and step the optimizer themselves.

* :mod:`raycomp.integrations.lightning`: ``RaycompStrategy``, in place of Ray's
  ``RayDDPStrategy`` in a ``lightning.Trainer`` (``pip install "./raycomp[lightning]"``).
* :mod:`raycomp.integrations.transformers`: ``prepare_trainer``, in place of Ray's
  ``ray.train.huggingface.transformers.prepare_trainer`` for a Hugging Face ``Trainer``
  (``pip install "./raycomp[transformers]"``).

Each imports its framework; this package and the rest of raycomp import neither. Both put
raycomp's comm hook on the DDP model the framework built, link the worker to the
controller, and follow the framework's step through :class:`~raycomp.integrations.framework_step.FrameworkStep`
(``loop.after_backward`` before its optimizer step, ``loop.after_optimizer_step`` after it);
raycomp's own state is checkpointed beside the framework's checkpoint
(:mod:`raycomp.integrations.state_files`).
"""
