"""onebit inside training frameworks: each recipe puts onebit's DDP communication hook on the
``DistributedDataParallel`` model the framework builds, following the onebit optimizer it
steps, so that DDP averages gradients only in the warm-up and the 1-bit exchange replaces it
afterwards. Without it DDP keeps sending every gradient densely (the optimizer warns at its
first compression step).

* :mod:`onebit.integrations.hf`: ``transformers.Trainer`` (:class:`~onebit.integrations.hf.
  OneBitCallback`) and ``accelerate`` (:func:`~onebit.integrations.hf.register_comm_hook`
  after ``accelerator.prepare``); install ``onebit[hf]``.
* :mod:`onebit.integrations.lightning`: :class:`~onebit.integrations.lightning.
  OneBitDDPStrategy` for ``lightning``; install ``onebit[lightning]``.
"""
