"""The batches each process draws, and the original run on all of them at once (a mixin of
harness.py's ``Recorder``; loaded from its file as the harness is).

On several processes (DDP: Fabric's, Accelerate's) each process trains on its own batch and the
gradients are averaged: one step is the step the original makes on the union of the processes'
batches (a mean loss over equal batches). To compare the two, the verifier

- records, in every process of the rewritten run (``record_batches``: at most that many batches
  per pass), the sample indices of each batch its loaders' samplers give, pass by pass (every
  ``iter()`` of a batch sampler, in order), and whether a BatchNorm normalised a training batch
  (each process over its own: not the original's statistics);
- runs the original once more (``replay``: a JSON file of the union's batches, pass by pass),
  each pass of its loaders drawing the union's batches instead of its sampler's; and, for the
  run that measures what other random draws alone change (``reseed``), with torch, random and
  numpy seeded again after the first step (dropout masks, augmentations).

Only the loader's sampler is stood in for, for the one ``iter()`` (the loader's own attribute is
set back at once); nothing of this runs unless the verifier asks for it.
"""

from __future__ import annotations

import json
import operator
from typing import Any, Optional


def _length(loader) -> Optional[int]:
    try:
        return len(loader.dataset)
    except TypeError:
        return None


class _Sampled:
    """A loader's (batch) sampler for one pass: what it yields is recorded, or replaced by the
    union's batches of the same pass."""

    def __init__(self, recorder, real, length: Optional[int], batch_size: Optional[int]) -> None:
        self.recorder, self.real, self.length, self.batch_size = recorder, real, length, batch_size

    def __len__(self) -> int:
        return len(self.real)

    def __getattr__(self, name: str) -> Any:  # a loader's iterator reading the sampler's own fields
        if name in ("recorder", "real", "length", "batch_size"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.real, name)

    def __iter__(self):
        recorder = self.recorder
        try:  # the batches of a pass, as ``len(loader)`` says (each process's own)
            count: Optional[int] = len(self.real)
        except TypeError:
            count = None
        entry: dict = {"length": self.length, "batch_size": self.batch_size, "count": count, "batches": []}
        index = len(recorder.sampled)
        recorder.sampled.append(entry)
        source = recorder._replayed(index, self.length)
        cap = recorder.record_batches
        for batch in (self.real if source is None else source):
            kept = entry["batches"]
            if cap and kept is not None and len(kept) < cap:
                try:
                    kept.append([operator.index(i) for i in batch])
                except TypeError:  # not a batch of indices (an iterable dataset's, a dict's)
                    entry["batches"] = None
            recorder._pass = entry  # the steps that follow are this pass's (a training pass)
            yield batch


class Shards:
    """``Recorder``'s part for several processes (``self`` is the Recorder)."""

    def _init_shards(self, config: dict) -> None:
        #: per pass of a sampler: {"length": len(dataset), "batches": [[index, ...], ...], "steps":
        #: the optimizer steps made while it was the pass that gave the last batch}
        self.sampled: list[dict] = []
        self.record_batches: Optional[int] = config.get("record_batches")
        self.replay: Optional[list] = None
        self.replay_problem: Optional[str] = None
        #: (len(dataset), batch_size) -> the batches of a pass on each process: what ``len(loader)``
        #: says in the run on the joined batches, as it said in the processes (a schedule's length)
        self.replay_counts: dict[tuple, int] = {}
        if config.get("replay"):
            with open(config["replay"]) as handle:
                self.replay = json.load(handle)
            seen: dict[tuple, set] = {}
            for entry in self.replay:
                if entry is not None and entry.get("count") is not None:
                    seen.setdefault((entry["length"], entry.get("batch_size")), set()).add(entry["count"])
            self.replay_counts = {key: counts.pop() for key, counts in seen.items() if len(counts) == 1}
        self.reseed: Optional[int] = config.get("reseed")
        self.batch_norm_trained = False
        self._pass: Optional[dict] = None  # the pass that gave the last batch

    @property
    def shards_on(self) -> bool:
        return bool(self.record_batches or self.replay is not None)

    def _replayed(self, index: int, length: Optional[int]) -> Optional[list]:
        """The union's batches for this pass, or None (the sampler's own; why, said once)."""
        if self.replay is None or self.replay_problem is not None:
            return None
        if index >= len(self.replay) or self.replay[index] is None:
            self.replay_problem = (f"the original's loaders made a pass ({index + 1}) whose batches the "
                                   "processes did not all record alike")
        elif self.replay[index]["length"] != length:
            self.replay_problem = (f"pass {index + 1} of the original's loaders reads a dataset of {length} "
                                   f"samples, the processes' one of {self.replay[index]['length']}")
        else:
            return self.replay[index]["batches"]
        return None

    def _sampled_iter(self, loader, original):
        """``DataLoader.__iter__`` with the loader's sampler recorded or replayed for this pass."""
        if not self.shards_on:
            return original(loader)
        name = "batch_sampler" if getattr(loader, "_auto_collation", False) else "sampler"
        real = getattr(loader, name, None)
        if real is None:
            return original(loader)
        # (Accelerate's loader has a batch sampler, BatchSamplerShard, which knows the batch size)
        size = loader.batch_size if loader.batch_size is not None else getattr(real, "batch_size", None)
        object.__setattr__(loader, name, _Sampled(self, real, _length(loader), size))
        try:
            return original(loader)
        finally:
            object.__setattr__(loader, name, real)

    def _replayed_len(self, loader, original) -> int:
        """``len(loader)`` in the run on the joined batches: each process's count of batches, where
        the processes' passes over a dataset of this length in batches of this size said one."""
        count = self.replay_counts.get((_length(loader), getattr(loader, "batch_size", None))) \
            if self.replay_counts else None
        return original(loader) if count is None else count

    def _hook_batch_norm(self, torch) -> None:
        """Whether a BatchNorm (not SyncBatchNorm, which has its own forward) normalised a
        training batch over its statistics: each process's are its own batch's."""
        if not self.record_batches:
            return
        recorder = self
        cls = torch.nn.modules.batchnorm._BatchNorm
        original = cls.forward

        def forward(self_, *args, **kwargs):
            if self_.training and torch.is_grad_enabled():
                recorder.batch_norm_trained = True
            return original(self_, *args, **kwargs)

        cls.forward = forward

    def _after_step(self, steps: int) -> None:
        """A step of the first optimizer: counted in the pass that gave the last batch; in the run
        that measures other random draws, everything seeded again after step 1."""
        if self._pass is not None:
            self._pass["steps"] = self._pass.get("steps", 0) + 1
        if self.reseed is not None and steps == 1:
            self._seed_all(self.reseed)

    def _shards_record(self) -> dict:
        return {"sampled": self.sampled if self.record_batches else None,
                "batch_norm_trained": self.batch_norm_trained, "replay_problem": self.replay_problem}
