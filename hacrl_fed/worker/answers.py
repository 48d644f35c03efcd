"""One set of weights' greedy answers on a private split, read as far as a sequential test asks (issue 44;
:mod:`hacrl_fed.algorithm.sequential`): :class:`Answers` keeps the correctness vector of the prompts read so far and
reads more, in the split's order, only when asked; :func:`on_engine` runs a read with other parameters on the
engine (the guard's reference or shadow) and puts the learner's back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

from hacrl_fed.worker.learner import Learner

Read = Callable[[int, int], list[bool]]  # (start, stop) -> correctness of prompts[start:stop]
T = TypeVar("T")


class Answers:
    """The correctness vector of one set of weights on a split's first prompts (``known``), extended by ``read``."""

    def __init__(self, read: Read, known: Sequence[bool] = ()):
        self.read, self.known = read, list(known)

    def upto(self, n: int) -> list[bool]:
        """The vector on the first ``n`` prompts, reading those not read yet."""
        if len(self.known) < n:
            self.known += self.read(len(self.known), n)
        return self.known[:n]


def chunk(prompts: Sequence[Any], start: int, stop: int) -> Sequence[Any]:
    """``prompts[start:stop]``, the very list when that is all of it."""
    return prompts if start == 0 and stop >= len(prompts) else prompts[start:stop]


def on_engine(
    learner: Learner,
    params: Callable[[], dict[str, torch.Tensor]],
    run: Callable[[], T],
    swap: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> T:
    """``run()`` with ``params()`` on the model and engine; the learner's own parameters put back whatever happens
    (``swap()``: a context around each of the two swaps, e.g. a CPU tally's part)."""
    with swap():
        mine = learner.params()
        learner.load_params(params(), sync=True)
    try:
        return run()
    finally:
        with swap():
            learner.load_params(mine, sync=True)
