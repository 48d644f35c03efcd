"""A learner's weights and trainer state kept in a file, not in memory (:class:`Stash`): the outcome guard's
reference and shadow (:mod:`hacrl_fed.worker.outcome`, :mod:`hacrl_fed.worker.shadow`) and the learner's own while
the shadow is on the model.

A stash is written from the live tensors (:meth:`~hacrl_fed.worker.learner.Learner.live`: no copy in memory first)
to a temporary file renamed over the stash (a reader's mapping of the old file stays valid), and read back
memory-mapped (``torch.load(mmap=True, weights_only=True)``): the pages are read from disk as they are copied onto
the model and are the page cache's, not the process's, once the mapping is dropped. So the guard adds to a
learner's live memory at most one more copy of the weights and trainer state, and only while one is being copied.
Because a stash is only ever replaced by a rename, a worker checkpoint keeps its file as a hard link
(:meth:`Stash.file`, :mod:`hacrl_fed.worker.checkpoint_files`) and a resume takes it back the same way
(:meth:`Stash.take`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hacrl_fed.worker.checkpoint_files import LinkedFile, link_or_copy
from hacrl_fed.worker.weights import Saved


class Stash:
    """One :data:`~hacrl_fed.worker.weights.Saved` in the file ``path`` (module doc)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def put(self, saved: Saved) -> None:
        """Write ``saved`` (the learner's live tensors, or a copy) as this stash."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"params": saved[0], "state": saved[1]}, tmp)
        os.replace(tmp, self.path)

    def file(self) -> LinkedFile:
        """This stash's file, for a checkpoint to keep by link (:mod:`hacrl_fed.worker.checkpoint_files`): it is
        never written in place, a new version is renamed over it."""
        return LinkedFile(self.path)

    def take(self, source: LinkedFile) -> None:
        """Make ``source``'s file (a checkpoint's) this stash, by link where the file system allows: the same
        bytes, none rewritten."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        link_or_copy(source.path, tmp)
        os.replace(tmp, self.path)

    def get(self) -> Saved:
        """The stash, memory-mapped (copy it onto the model: the learner's ``load_weights`` does)."""
        data = torch.load(self.path, mmap=True, weights_only=True)
        return data["params"], data["state"]

    def params(self) -> dict[str, torch.Tensor]:
        """The stash's trainable weights alone, memory-mapped."""
        return self.get()[0]

    def drop(self) -> None:
        """Remove the file (a monitor starting another run)."""
        self.path.unlink(missing_ok=True)
