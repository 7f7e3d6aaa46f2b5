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
"""
import collections
import copy

import torch


def to_device(batch, device):
    """batch with every tensor copied to device (non_blocking), through
    tuples, named tuples, lists and mappings (a Hugging Face BatchEncoding
    included), as DataLoader's pin_memory walks them; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, collections.abc.Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        if isinstance(batch, collections.abc.MutableMapping):
            # Keeps the mapping's type and its other attributes
            # (BatchEncoding's encodings), as pin_memory does.
            clone = copy.copy(batch)
            clone.update(moved)
            return clone
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
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
                    queue.append(to_device(next(batches), device))
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


class _FedBelow:
    """Stands in for an Accelerate loader's base_dataloader while a
    DeviceLoader iterates it: the base's batches come out on the device,
    ahead, and everything else is the base's."""

    def __init__(self, base, device, prefetch):
        self._base, self._device, self._prefetch = base, device, prefetch

    def __iter__(self):
        return _ahead(iter(self._base), self._device, self._prefetch)

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

    With a loader that Accelerate prepared, the copies are issued below
    Accelerate's wrapper (its base_dataloader yields device batches while
    this iterates), so Accelerate's end-of-data state, which
    `gather_for_metrics` and `accumulate` read, changes at the user's
    batch, not at the one fetched ahead.
    """

    def __init__(self, loader, device=None, prefetch=2):
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

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":  # (before __init__ set it: copy, pickle)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        if _accelerate_base(self.loader):
            return self._below_accelerate()
        return _ahead(iter(self.loader), self.device, self.prefetch)

    def _below_accelerate(self):
        loader = self.loader
        base = vars(loader)["base_dataloader"]
        loader.base_dataloader = _FedBelow(base, self.device, self.prefetch)
        try:
            yield from loader
        finally:
            loader.base_dataloader = base
