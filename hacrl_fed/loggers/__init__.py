"""Optional metrics sinks next to ``metrics.jsonl`` and TensorBoard (:class:`hacrl_fed.metrics.RunLogger`):
each has ``log(round, metrics)`` and ``close()``. :mod:`hacrl_fed.loggers.wandb`: Weights & Biases."""
