"""``torch.distributed.checkpoint`` (DCP) into the agents' memory.

    import torch.distributed.checkpoint as dcp
    import rlaunch.dcp

    step = rlaunch.dcp.restored_step()          # the step this round restores, or None
    if step is not None:
        dcp.load(state, storage_reader=rlaunch.dcp.Reader())
    ...
    dcp.save(state, storage_writer=rlaunch.dcp.Writer(step))     # or dcp.async_save(...)

Each rank's share of the checkpoint (the tensors and shards DCP's planner gives it, and its
serialized objects) becomes that rank's part of ``step`` in ``rlaunch.snapshot``: held by its
node's agent, replicated to the buddy node, and committed by the same rule as
``rlaunch.snapshot.save`` (a step is restored only when every rank's part of it is held). DCP's
global metadata goes with the coordinator's part, which is saved last (DCP calls ``finish`` on the
coordinator once every rank has written): a step whose metadata is held has every part written.
Tensor bytes travel raw (no pickle); the metadata is kept as plain containers, rebuilt on load.

``Reader`` reads each item from the part of the rank that wrote it (``rlaunch.snapshot.load(rank=k)``,
copy-on-write views of the agents' buffers), so a world of another size loads with DCP's own
resharding (tested with DDP's replicated state and FSDP2's sharded state, four ranks to two). Each rank
reads rank 0's part (the metadata) and the parts holding the items it loads: a node must have
room in its snapshot memory for what its ranks read of other nodes.

Objects saved beside the tensors (a step counter, an optimizer's param_groups) are what DCP's
planner loads with ``torch.load``: ``Reader`` first checks each with ``torch.load(weights_only=
True)`` (and the classes named in ``allow``), so that a part runs no code in the ranks that load
it; ``Reader(trust_objects=True)`` leaves them to DCP as DCP leaves its files.

One ``Writer`` per save, one ``Reader`` per load; both need DCP's collectives (the default
``use_collectives=True``).

Outside rlaunch ``Writer`` saves nothing and ``restored_step`` answers None (said once by
``rlaunch.snapshot``); ``Reader`` then raises ``SnapshotError``. When a part does not fit in the
node's snapshot memory, that step is not committed (``Writer.saved`` is False) and training goes
on; the last committed step stays.
"""

import dataclasses
import io
import os

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from . import snapshot
from .snapshot import SnapshotError

__all__ = ["Reader", "Writer", "restored_step"]

# Marks a part written by Writer (a part saved by rlaunch.snapshot.save is not DCP's).
_MARK = "rlaunch.dcp"
_TENSOR_FIELDS = {f.name for f in dataclasses.fields(TensorProperties)}


def _rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    # (Outside rlaunch and without a process group: one process, which saves nothing.)
    return int(os.environ.get("RANK") or 0)


def _done(value):
    # DCP waits on torch's futures (``.wait()``).
    f = torch.futures.Future()
    f.set_result(value)
    return f


def restored_step(*, allow=()):
    """The step this round restores (the same on every rank), or None: no step is held for this
    round, or outside rlaunch. ``allow``: as for ``Reader``."""
    got = snapshot.load(allow=allow)
    return None if got is None else got[0]


def _encode(md):
    """DCP's metadata as plain containers (what ``rlaunch.snapshot`` loads without running code)."""
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = None
            continue
        p = m.properties
        entries[fqn] = {
            "dtype": p.dtype,
            "requires_grad": bool(p.requires_grad),
            "strides": None if getattr(p, "strides", None) is None else tuple(p.strides),
            "size": tuple(m.size),
            "chunks": [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks],
        }
    storage = [
        (i.fqn, None if i.offset is None else tuple(i.offset), i.index, tuple(where))
        for i, where in (md.storage_data or {}).items()
    ]
    return {"version": md.version, "entries": entries, "planner_data": md.planner_data, "storage": storage}


def _decode(d):
    sdm = {}
    for fqn, e in d["entries"].items():
        if e is None:
            sdm[fqn] = BytesStorageMetadata()
            continue
        props = {"dtype": e["dtype"], "requires_grad": e["requires_grad"]}
        if "strides" in _TENSOR_FIELDS and e.get("strides") is not None:
            props["strides"] = tuple(e["strides"])
        sdm[fqn] = TensorStorageMetadata(
            properties=TensorProperties(**props),
            size=torch.Size(e["size"]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in e["chunks"]],
        )
    storage = {
        MetadataIndex(fqn, None if off is None else torch.Size(off), idx): tuple(where)
        for fqn, off, idx, where in d["storage"]
    }
    return Metadata(state_dict_metadata=sdm, planner_data=d["planner_data"], storage_data=storage, version=d["version"])


def _step_of(checkpoint_id):
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    raise ValueError(f"rlaunch.dcp: a checkpoint_id is the step (an int), not {checkpoint_id!r}")


class Writer(StorageWriter):
    """A ``StorageWriter`` that keeps ``step`` in the agents' memory (see the module), for one
    ``dcp.save`` (or ``dcp.async_save``): a new one for each step (``Writer(step)``, or
    ``dcp.save(..., checkpoint_id=step, storage_writer=Writer())``). ``saved`` says afterwards
    whether this rank's part is held (False outside rlaunch, or when it did not fit in the node's
    snapshot memory)."""

    def __init__(self, step=None):
        super().__init__()
        self.step = None if step is None else _step_of(step)
        self.saved = False
        self._coordinator = False
        self._items = None
        self._used = False

    def _once(self):
        # A second save through the same writer (an async_save still writing the first, in
        # another thread) would mix the two steps.
        if self._used:
            raise ValueError("rlaunch.dcp.Writer: one writer per save (make a new Writer(step) for each)")

    def reset(self, checkpoint_id=None):
        # (DCP calls this as a save begins only when given a checkpoint_id.)
        self._once()
        if checkpoint_id is not None:
            step = _step_of(checkpoint_id)
            if self.step is not None and step != self.step:
                raise ValueError(f"rlaunch.dcp.Writer({self.step}) given checkpoint_id={checkpoint_id!r}")
            self.step = step

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        # (DCP calls this as every save begins.)
        self._once()
        self._used = True
        if kwargs.get("use_collectives") is False:
            raise ValueError(
                "rlaunch.dcp.Writer needs DCP's collectives (use_collectives=True): the coordinator's "
                "metadata must describe every rank's items"
            )
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        if self.step is None:
            raise ValueError("rlaunch.dcp.Writer: no step (give Writer(step) or dcp.save(..., checkpoint_id=step))")
        rank = _rank()
        items, results = {}, []
        for n, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = str(n)
            if item.type == WriteItemType.BYTE_IO:
                value = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                size = len(value)
            else:
                value = data.detach()
                if not value.is_contiguous():
                    value = value.contiguous()
                size = value.numel() * value.element_size()
            items[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=(rank, key)))
        self._items = items
        if not self._coordinator:
            self.saved = bool(snapshot.save(self.step, {_MARK: 1, "items": items}))
            self._items = None
        return _done(results)

    def finish(self, metadata, results):
        # The coordinator, once every rank wrote: its part carries the metadata, and commits last.
        storage = {}
        for per_rank in results:
            for r in per_rank:
                storage[r.index] = r.storage_data
        metadata.storage_data = storage
        part = {_MARK: 1, "items": self._items or {}, "metadata": _encode(metadata)}
        self._items = None
        self.saved = bool(snapshot.save(self.step, part))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        # Never picked from a checkpoint_id alone: a writer is given.
        return False


class Reader(StorageReader):
    """A ``StorageReader`` for the step this round restores (see the module), for one
    ``dcp.load``. ``allow``: classes that DCP's planner data and the saved objects may name, as
    for ``rlaunch.snapshot.load`` (the default planner's need none). ``trust_objects=True``: the
    saved objects go to DCP's planner unchecked (it unpickles them, running what they name)."""

    def __init__(self, *, allow=(), trust_objects=False):
        super().__init__()
        self._allow = allow
        self._trust = trust_objects
        self._parts = {}
        self._wanted = None
        self.step = None
        self.storage_data = {}

    def reset(self, checkpoint_id=None):
        self._parts = {}
        self.step = None
        self._wanted = None if checkpoint_id is None else _step_of(checkpoint_id)

    def _part(self, rank):
        if rank not in self._parts:
            got = snapshot.load(rank=rank, allow=self._allow)
            if got is None:
                raise SnapshotError(
                    "rlaunch.dcp: no step to load (outside rlaunch, or none held for this round: "
                    "rlaunch.dcp.restored_step() says which)"
                )
            step, part = got
            if self.step is None:
                self.step = step
            elif step != self.step:
                raise SnapshotError(f"rlaunch.dcp: rank {rank}'s part is of step {step}, not {self.step}")
            if part is not None and not (isinstance(part, dict) and part.get(_MARK) == 1):
                raise SnapshotError(f"rank {rank}'s part of step {step} was not saved by rlaunch.dcp.Writer")
            self._parts[rank] = part
        return self._parts[rank]

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            # DCP's fallback to rank-local metadata, after the collective read failed on this
            # rank: the others took the collective path, so this one must fail, not go on alone.
            raise SnapshotError("rlaunch.dcp: no rank-local metadata (the read of rank 0's part failed)")
        # Not a previous load's parts or step (a Reader kept across rounds).
        self._parts, self.step = {}, None
        self._part(0)
        if self._wanted is not None and self.step != self._wanted:
            raise SnapshotError(f"rlaunch.dcp: this round restores step {self.step}, not {self._wanted}")
        rank = 0
        while True:
            part = self._part(rank)
            if part is None:
                raise SnapshotError(f"rlaunch.dcp: no rank's part of step {self.step} holds DCP's metadata")
            if "metadata" in part:
                md = _decode(part["metadata"])
                self.storage_data = md.storage_data
                return md
            rank += 1

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if kwargs.get("use_collectives") is False:
            raise ValueError("rlaunch.dcp.Reader needs DCP's collectives (use_collectives=True)")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        for req in plan.items:
            where = self.storage_data.get(req.storage_index)
            if where is None:
                raise SnapshotError(f"rlaunch.dcp: step {self.step} has no item {req.storage_index}")
            rank, key = where
            part = self._part(rank)
            if part is None or key not in part.get("items", {}):
                raise SnapshotError(f"rlaunch.dcp: rank {rank}'s part of step {self.step} lacks item {key}")
            value = part["items"][key]
            if req.type == LoadItemType.BYTE_IO:
                value = bytes(value)
                if not self._trust:
                    self._check_object(req.storage_index.fqn, rank, value)
                planner.load_bytes(req, io.BytesIO(value))
                continue
            src = value
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if length < src.size(dim):
                    src = src.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise SnapshotError(
                    f"rlaunch.dcp: {req.storage_index.fqn}: the saved chunk is {tuple(src.size())}, "
                    f"the state asks for {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        return _done(None)

    def _check_object(self, fqn, rank, value):
        """Refuses a saved object that ``torch.load(weights_only=True)`` would not build (with
        the classes in ``allow``), before DCP's planner unpickles it."""
        allowed = [a for a in self._allow if not isinstance(a, str)]
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(io.BytesIO(value), weights_only=True)
        except Exception as e:
            raise snapshot.GlobalNotAllowed(
                f"rlaunch.dcp: {fqn!r} in rank {rank}'s part of step {self.step} is an object that "
                f"torch.load(weights_only=True) refuses ({e}); nothing of it was run. If you trust "
                "whoever saved it, allow its classes (Reader(allow=[...])) or Reader(trust_objects=True)",
                fqn,
            ) from None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False
