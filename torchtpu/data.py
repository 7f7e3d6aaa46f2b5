"""torchtpu.data.DeviceLoader: batches copied to the device ahead of the step
that needs them, so that the copy of the next batches overlaps the current
step's compute (PyTorch/XLA's MpDeviceLoader plays this part there).

    loader = DataLoader(dataset, batch_size=64, pin_memory=True, num_workers=2)
    for x, y in torchtpu.data.DeviceLoader(loader):   # x, y already on tpu
        loss = loss_fn(model(x), y)

Why a wrapper, and not the same behaviour from `DataLoader(pin_memory=True)`
plus `.to("tpu", non_blocking=True)` in the loop: the loop's `.to()` runs
after the loader has handed the batch over, too late to start the copy any
earlier, and a DataLoader does not know where its batches go. Uploading
them on the loader's own initiative would change what every pinned
DataLoader yields (tpu tensors where the code asked for CPU ones), hold device
memory for batches some code never sends, and pick a device (or a dtype) for
the user: each a surprise. The wrapper says in one line that its batches
live on the device, as MpDeviceLoader does.

It adds no thread and no copy of its own: each batch goes through
`.to(device, non_blocking=True)`, which from pinned memory
(`DataLoader(pin_memory=True)`, pinned on the DataLoader's own thread)
starts an asynchronous transfer and returns (torchtpu/pinned.py); from
ordinary memory it takes a host copy first, whose upload is still
asynchronous. Loading stays the DataLoader's (its workers, its pinning
thread), so an early `break` leaves nothing running, and an error the
DataLoader raises while fetching ahead is held until the batches before it
have been used, then raised at the user's loop line, as the plain loop
would.

Batches of varying length (Hugging Face's dynamic padding) are padded to a
few bucket lengths before upload, where padding is known to leave the
model's results as they were (torchtpu/buckets.py), so a model compiles a
program per bucket, not per length: `buckets=` says which, or turns it off.
"""
import collections

import torch

from .buckets import Bucketer, replaced
from .dispatch.lengths import uploads_as_they_are


def to_device(batch, device):
    """batch with every tensor copied to device (non_blocking), through
    tuples, named tuples, lists and mappings (a Hugging Face BatchEncoding
    included), as DataLoader's pin_memory walks them; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, collections.abc.Mapping):
        # Keeps the mapping's type and its other attributes (BatchEncoding's
        # encodings), as pin_memory does.
        return replaced(batch, {k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _ahead(batches, device, prefetch):
    """The batches of the iterator `batches` on device, each issued `prefetch`
    batches before it is yielded. An Exception from `batches` is raised once
    the batches fetched before it have been yielded."""
    queue = collections.deque()
    error = None
    try:
        while True:
            while batches is not None and len(queue) <= prefetch:
                try:
                    batch = next(batches)
                    # The loader pads its batches itself (buckets), or was
                    # told not to: no upload of it takes a length as varying.
                    with uploads_as_they_are():
                        queue.append(to_device(batch, device))
                except StopIteration:
                    batches = None
                except Exception as e:
                    error, batches = e, None
            if not queue:
                if error is not None:
                    raise error
                return
            yield queue.popleft()
    finally:
        # An early break: drop the batches issued ahead and the source's
        # iterator now (its DataLoader workers and pinning thread end with it).
        queue.clear()
        batches = None


class FedBelow:
    """Stands in for an Accelerate loader's base_dataloader while the
    loader iterates: the base's batches come out through feed(iterator)
    (bucketed; on the device, ahead, under a DeviceLoader), and everything
    else is the base's."""

    def __init__(self, base, feed):
        self._base, self._feed = base, feed

    def __iter__(self):
        return self._feed(iter(self._base))

    def __len__(self):
        return len(self._base)

    def __getattr__(self, name):
        return getattr(self._base, name)

    @property
    def __class__(self):
        return self._base.__class__


def _accelerate_base(loader):
    """Whether loader is one Accelerate prepared that DeviceLoader feeds from
    below (see DeviceLoader)."""
    try:
        from accelerate.data_loader import DataLoaderDispatcher, DataLoaderStateMixin
    except ImportError:
        return False
    if not isinstance(loader, DataLoaderStateMixin) or "base_dataloader" not in vars(loader):
        return False
    if isinstance(loader, DataLoaderDispatcher) or getattr(loader, "use_stateful_dataloader", False):
        # The dispatcher broadcasts CPU batches from process 0; a stateful
        # loader's state_dict would count the batches fetched ahead.
        raise NotImplementedError(
            "DeviceLoader: Accelerate's dispatch_batches and use_stateful_dataloader loaders are "
            "not supported; prepare the DataLoader without them")
    return True


class DeviceLoader:
    """Iterates `loader` with its batches on `device` (default: the current
    tpu device, `tpu:LOCAL_RANK` in each process of a launch), each copied
    `prefetch` batches ahead of the step that uses it.

    `len()`, and any other attribute (`dataset`, `sampler`, `set_epoch`),
    are the loader's; each `iter()` is one epoch of the loader.

    buckets: the lengths Hugging Face batches (mappings with an
    `attention_mask`) are padded to before upload, where that leaves the
    model's results as they were (torchtpu/buckets.py): "auto" (as
    TORCHTPU_BUCKETS says; by default True), True (powers of two from 16, up
    to the collator's tokenizer's model_max_length), a list of lengths, or
    None/False (off: every batch as the loader gives it). pad_values:
    {field: pad value} for fields the loader cannot know, or overriding
    its choice; {field: None} for one that does not vary with the length.

    With a loader that Accelerate prepared, the copies are issued below
    Accelerate's wrapper (its base_dataloader yields device batches while
    this iterates), so Accelerate's end-of-data state, which
    `gather_for_metrics` and `accumulate` read, changes at the user's
    batch, not at the one fetched ahead.
    """

    def __init__(self, loader, device=None, prefetch=2, buckets="auto", pad_values=None):
        if device is None:
            device = getattr(loader, "device", None) if _accelerate_base(loader) else None
        if device is None:
            device = torch.device("tpu", torch.tpu.current_device())
        device = torch.device(device)
        if device.type != "tpu":
            raise ValueError(f"DeviceLoader feeds a tpu device, not {device}")
        if device.index is None:
            device = torch.device("tpu", torch.tpu.current_device())
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"DeviceLoader: prefetch must be an int >= 0, not {prefetch!r}")
        self.loader, self.device, self.prefetch = loader, device, prefetch
        self.bucketer = Bucketer(buckets, pad_values, loader)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":  # (before __init__ set it: copy, pickle)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        if _accelerate_base(self.loader):
            return fed_below(self.loader, self._feed)
        return self._feed(iter(self.loader))

    def _feed(self, batches):
        return _ahead(self.bucketer.padded(batches), self.device, self.prefetch)


def fed_below(loader, feed):
    """Iterates an Accelerate loader with its base_dataloader's batches
    going through feed(iterator) (FedBelow)."""
    base = vars(loader)["base_dataloader"]
    loader.base_dataloader = FedBelow(base, feed)
    try:
        yield from loader
    finally:
        loader.base_dataloader = base
