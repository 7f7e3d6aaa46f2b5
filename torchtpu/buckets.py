"""Host batches padded to a few lengths before upload, so that a model fed
batches of many lengths (Hugging Face's dynamic padding: each batch padded
to its own longest sequence) compiles a few programs, not one per length.

The loader knows what the program cannot: that its tensors are batches, and,
by the names Hugging Face gives their fields, which dim is the sequence and
what a padded position holds. Each field is padded along its last dim as the
collator pads it:

| field | padded with |
|---|---|
| `input_ids`, `decoder_input_ids` | the pad id the batch's own padding shows, else the collator's tokenizer's `pad_token_id` |
| `attention_mask`, `decoder_attention_mask` | 0 |
| `token_type_ids` | the tokenizer's `pad_token_type_id` (0) |
| `position_ids`, `decoder_position_ids` | 0 |
| `special_tokens_mask` | 1 |
| `labels`, `label_ids` (integer, one per token) | the collator's `label_pad_token_id`, else -100 |

A model that reads its attention mask then attends to none of the added
positions, and a loss that ignores -100 (cross entropy's default, every
Hugging Face model's loss) counts none of them, so the outputs at the true
positions and the loss are the unpadded batch's. Where that is not known, the
batch is uploaded as it is (a program for its length, exact), with a warning
saying why once batches of two lengths were left for that reason:

- a batch with no `attention_mask`: the model would read the added positions
  as tokens;
- a tensor of another name with a dim of the batch's length (`inputs_embeds`,
  a per-token weight, a 2-D mask): what its padded positions should hold is
  the model's business (`pad_values={"name": value}` says it, `None` that it
  does not vary with the length);
- left padding without `position_ids`: more pads on the left would move the
  true tokens to later positions in a model that numbers them from 0 (GPT-2,
  BERT); the decoder side of an encoder-decoder batch padded on the left,
  for the same reason;
- a pad id neither the batch nor the collator shows; and, without a
  warning, a batch whose padding side nothing shows yet (no padding in it,
  no tokenizer, no batch before it that had some).

Encoder-decoder batches (`labels` of another length than `input_ids`, from
`DataCollatorForSeq2Seq`, or with `decoder_*` fields) have their decoder
fields padded to a bucket of their own, on the right: a decoder is causal, so
positions past the true ones change nothing before them.

The batch dim is not padded: rows of zeros would enter a mean over the batch
(a regression loss, batch norm); a last short batch compiles once.

Used by `torchtpu.data.DeviceLoader` and by the Accelerate integration (the
loaders `Accelerator.prepare` and `Trainer` make), one `Bucketer` a loader.
"""
import collections.abc
import copy
import warnings

import torch

from . import config

FLOOR = 16  # smallest default bucket; see _power_bucket
POWERS = "powers of two"  # the default lengths: powers of two from FLOOR
# Tokenizers with no length limit say int(1e30) (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 1 << 40

_ENCODER = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "special_tokens_mask")
_DECODER = ("decoder_input_ids", "decoder_attention_mask", "decoder_position_ids")
_LABELS = ("labels", "label_ids")


def lengths_from(spec, name="buckets"):
    """The bucket lengths that `spec` asks for: POWERS, a sorted tuple of
    lengths, or None (off). spec: "auto" (TORCHTPU_BUCKETS: on, off or a
    comma list), True, None or False, or an iterable of positive ints."""
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(f"{name} must be 'auto', True, None, False or a list of lengths, "
                             f"not {spec!r}")
        text = config.BUCKETS.text()
        if not config.BUCKETS.on():
            return None
        if text.lower() in ("1", "on", "true", "yes"):
            return POWERS
        name = config.BUCKETS.name
        try:
            spec = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{name} must be on, off or a comma list of lengths "
                             f"(32,64,128), not {text!r}") from None
    if spec is True:
        return POWERS
    if spec is None or spec is False:
        return None
    if not isinstance(spec, collections.abc.Iterable):
        raise TypeError(f"{name} must be 'auto', True, None, False or a list of lengths, "
                        f"not {type(spec).__name__}")
    lengths = list(spec)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"{name} must be a non-empty list of positive ints, not {spec!r}")
    return tuple(sorted(set(lengths)))


def _check_pad_values(pad_values):
    if pad_values is None:
        return {}
    if not isinstance(pad_values, collections.abc.Mapping):
        raise TypeError(f"pad_values must be a dict of field name -> pad value, "
                        f"not {type(pad_values).__name__}")
    for k, v in pad_values.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (int, float, bool))):
            raise TypeError(f"pad_values: {k!r}: {v!r}: expected a field name and a number, "
                            "or None for a field that does not vary with the length")
    return dict(pad_values)


def collator_of(loader):
    """The Hugging Face data collator behind loader.collate_fn (through
    Trainer's RemoveColumnsCollator and functools.partial), or None."""
    fn = getattr(loader, "collate_fn", None)
    for _ in range(8):
        if fn is None or hasattr(fn, "tokenizer") or hasattr(fn, "label_pad_token_id"):
            return fn
        fn = getattr(fn, "data_collator", None) or getattr(fn, "func", None)
    return None


def _names(obj):
    return {k.__name__ for k in type(obj).__mro__}


def _as_int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_mask(t):
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() >= 2 and \
        (t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()))


def _side(mask):
    """"right" or "left" as the 0s of a 0/1 mask show, None where no row has
    padding, "mixed" where rows disagree or the mask holds other values."""
    rows = mask.reshape(-1, mask.shape[-1])
    if rows.numel() == 0:
        return None
    if mask.dtype != torch.bool and bool(((rows != 0) & (rows != 1)).any()):
        return "mixed"
    first, last = rows[:, 0] != 0, rows[:, -1] != 0
    left, right = bool((~first & last).any()), bool((first & ~last).any())
    return "mixed" if left and right else "left" if left else "right" if right else None


def _uniform(values):
    """The one value of a tensor, or None where it has none or several."""
    if values.numel() == 0:
        return None
    first = values.reshape(-1)[0]
    return first.item() if bool((values == first).all()) else None


def _pad(t, length, side, value):
    out = t.new_full((*t.shape[:-1], length), value)
    if side == "left":
        out[..., length - t.shape[-1]:] = t
    else:
        out[..., :t.shape[-1]] = t
    return out


def replaced(batch, updates):
    """batch with the fields in updates replaced, its mapping type (and a
    BatchEncoding's other attributes) kept."""
    if isinstance(batch, collections.abc.MutableMapping):
        clone = copy.copy(batch)
        clone.update(updates)
        return clone
    merged = {**batch, **updates}
    try:
        return type(batch)(merged)
    except TypeError:
        return merged


class Bucketer:
    """Pads a loader's host batches to bucket lengths (see the module's
    docstring). spec: as lengths_from takes it, read again at each
    padded() (so TORCHTPU_BUCKETS changes apply from the next epoch);
    pad_values: field -> pad value, or None for a field that does not vary
    with the length; loader: where the collator (its tokenizer's pad id,
    padding side and length limit) is found."""

    def __init__(self, spec="auto", pad_values=None, loader=None):
        if not (isinstance(spec, str) and spec == "auto"):
            lengths_from(spec)  # bad arguments raise here, not at the first batch
        self.spec = spec
        self.lengths = None
        self.pad_values = _check_pad_values(pad_values)
        collator = collator_of(loader)
        tokenizer = getattr(collator, "tokenizer", None)
        self.pad_id = _as_int(getattr(tokenizer, "pad_token_id", None))
        self.type_pad = _as_int(getattr(tokenizer, "pad_token_type_id", None)) or 0
        side = getattr(tokenizer, "padding_side", None)
        self.side = side if side in ("left", "right") else None
        label_pad = _as_int(getattr(collator, "label_pad_token_id", None))
        self.label_pad = -100 if label_pad is None else label_pad
        limit = _as_int(getattr(tokenizer, "model_max_length", None))
        # Past the tokenizer's limit a bucket could pass the model's
        # positions (max_position_embeddings 77, 514...): the limit is the
        # last bucket.
        self.limit = limit if limit is not None and 0 < limit < _NO_LIMIT else None
        self.seq2seq = "DataCollatorForSeq2Seq" in _names(collator)
        padding = getattr(collator, "padding", None)
        # A collator padding every batch to max_length gives one length already.
        self.fixed = str(getattr(padding, "value", padding)) == "max_length"
        self._warned = set()
        self._left = {}  # warning -> lengths of the batches left as they are for it
        self._seen_side = {}  # "encoder"/"decoder" -> the side earlier batches showed
        self._seen_pad_id = None  # the pad id earlier batches showed

    def padded(self, batches):
        """The batches of the iterator `batches`, each padded (pad())."""
        self.lengths = None if self.fixed else lengths_from(self.spec)
        for batch in batches:
            yield self.pad(batch) if self.lengths is not None else batch

    # ---- one batch ------------------------------------------------------

    def bucket(self, n):
        """The length a dim of length n is padded to."""
        if self.lengths is POWERS:
            return _power_bucket(n, self.limit)
        for b in self.lengths:
            if b >= n:
                return b
        self._warn("longer", f"a batch of length {n} is longer than the largest bucket "
                   f"({self.lengths[-1]}): uploaded as it is, compiled for its length")
        return n

    def pad(self, batch):
        """batch with its sequence fields padded to their bucket, or batch
        itself where padding is not known to be exact."""
        if self.lengths is None or not isinstance(batch, collections.abc.Mapping):
            return batch
        mask = batch.get("attention_mask")
        if not _is_mask(mask):
            if mask is None and isinstance(batch.get("input_ids"), torch.Tensor):
                self._warn("mask", "batches with input_ids but no attention_mask are uploaded "
                           "as they are: the model would read added positions as tokens", batch)
            return batch
        length = mask.shape[-1]
        encoder = self._encoder(batch, length)
        if encoder is None:
            return batch
        groups = [encoder]
        decoder_length = self._decoder_length(batch, length)
        if decoder_length is not None:
            decoder = self._decoder(batch, decoder_length, set(encoder[2]))
            if decoder is None:
                return batch
            groups.append(decoder)
        covered = {name for _, _, fields in groups for name in fields}
        lengths = {n for n, _, _ in groups}
        for name, value in batch.items():
            if name in covered or not isinstance(value, torch.Tensor) or \
                    (name in self.pad_values and self.pad_values[name] is None):
                continue
            if any(d in lengths for d in value.shape[1:]):
                self._warn(("field", name), f"batches with a field {name!r} of shape "
                           f"{tuple(value.shape)} are uploaded as they are: what its padded "
                           f"positions hold is not known (pad_values={{{name!r}: value}} pads "
                           f"it along its last dim with value, {{{name!r}: None}} says it does "
                           "not vary with the length)", batch)
                return batch
        updates = {}
        for n, side, fields in groups:
            target = self.bucket(n)
            if target != n:
                updates.update({name: _pad(batch[name], target, side, value)
                                for name, value in fields.items()})
        return replaced(batch, updates) if updates else batch

    def _fields(self, batch, names, length):
        """The tensors of batch named in names (and pad_values) whose last dim
        is length: {name: tensor}; None where one of them cannot be padded
        here (on a device already)."""
        found = {}
        for name in (*names, *self.pad_values):
            value = batch.get(name)
            if name in found or not isinstance(value, torch.Tensor) or value.dim() < 2 or \
                    value.shape[-1] != length or \
                    (name in self.pad_values and self.pad_values[name] is None):
                continue
            if name in _LABELS and name not in self.pad_values and \
                    (value.is_floating_point() or value.dtype == torch.bool):
                continue  # not class ids, not to pad with -100: pad() leaves the batch
            if value.device.type != "cpu":
                return None
            found[name] = value
        return found

    def _encoder(self, batch, length):
        """(length, side, {field: pad value}) of the encoder's fields, or None."""
        mask = batch["attention_mask"]
        side = self._side_of(_side(mask), "encoder")
        if side is None:
            return None
        if side == "left" and "position_ids" not in batch:
            self._warn("left", "left-padded batches without position_ids are uploaded as they "
                       "are: more pads on the left would move the true tokens to later positions "
                       "in a model that numbers them from 0 (pass position_ids, e.g. "
                       "attention_mask.cumsum(-1) - 1 clamped at 0, to have them bucketed)", batch)
            return None
        found = self._fields(batch, (*_ENCODER, *_LABELS), length)
        if found is None:
            return None
        fields = {name: self._value(name, batch, mask) for name in found}
        if any(v is None for v in fields.values()):
            return None
        return length, side, fields

    def _decoder_length(self, batch, length):
        """The length of an encoder-decoder batch's decoder side, or None."""
        for name in _DECODER:
            if isinstance(batch.get(name), torch.Tensor) and batch[name].dim() >= 2:
                return batch[name].shape[-1]
        labels = next((batch[k] for k in _LABELS if isinstance(batch.get(k), torch.Tensor)), None)
        if self.seq2seq and labels is not None and labels.dim() >= 2 and labels.shape[-1] != length:
            return labels.shape[-1]
        return None

    def _decoder(self, batch, length, encoder_fields):
        """(length, "right", {field: pad value}) of the decoder's fields, or None."""
        mask = batch.get("decoder_attention_mask")
        if mask is not None and not _is_mask(mask):
            return None
        found = self._fields(batch, (*_DECODER, *_LABELS), length)
        if found is None:
            return None
        found = {k: v for k, v in found.items() if k not in encoder_fields}
        labels = next((k for k in _LABELS if k in found), None)
        if mask is not None:
            seen = _side(mask)
        elif labels is not None:
            seen = _side(found[labels] != self.label_pad)
        else:
            seen = None
        side = self._side_of(seen, "decoder")
        if side != "right":
            if side == "left":
                self._warn("decoder left", "encoder-decoder batches whose decoder side is padded "
                           "on the left are uploaded as they are: more pads on the left would "
                           "move the decoder's true tokens to later positions", batch)
            return None
        return length, side, {name: self._value(name, batch, mask) for name in found}

    def _side_of(self, seen, group):
        """The padding side: what the batch shows, else the tokenizer's, else
        what this loader's earlier batches showed; None where unknown."""
        if seen == "mixed":
            return None
        side = seen or self.side or self._seen_side.get(group)
        if side is not None:
            self._seen_side[group] = side
        return side

    def _value(self, name, batch, mask):
        """The pad value of field name, or None where it is not known."""
        if self.pad_values.get(name) is not None:
            return self.pad_values[name]
        if name in _LABELS:
            return self.label_pad
        if name in _CONSTANT:
            return _CONSTANT[name]
        if name == "token_type_ids":
            return self.type_pad
        return self._pad_id(name, batch, mask)  # input_ids, decoder_input_ids

    def _pad_id(self, name, batch, mask):
        """The pad id of the ids in field name: the one the batch's own
        padding holds, else the tokenizer's, else the one earlier batches
        held; None where none is known."""
        ids = batch[name]
        seen = _uniform(ids[mask == 0]) if mask is not None and ids.shape == mask.shape else None
        if name == "decoder_input_ids":
            # A causal decoder never reads a pad past the true tokens for
            # them: any valid id is exact.
            return seen if seen is not None else self.pad_id if self.pad_id is not None else 0
        pad_id = seen if seen is not None else self.pad_id if self.pad_id is not None \
            else self._seen_pad_id
        if pad_id is None:
            self._warn("pad id", "batches whose pad id is not known (no padding in the batch, no "
                       "tokenizer on the loader's collate_fn) are uploaded as they are; "
                       "pad_values={'input_ids': id} gives it", batch)
        self._seen_pad_id = pad_id
        return pad_id

    def _warn(self, key, message, batch=None):
        """Warn once for key; for a batch left as it is, once batches of two
        lengths were left for key (batches of one length need no bucket)."""
        if key in self._warned:
            return
        if batch is not None:
            lengths = self._left.setdefault(key, set())
            lengths.add(next((batch[k].shape[-1] for k in ("input_ids", "attention_mask")
                              if isinstance(batch.get(k), torch.Tensor) and batch[k].dim()), None))
            if len(lengths) < 2:
                return
        self._warned.add(key)
        warnings.warn(f"torchtpu buckets: {message}", stacklevel=2)


_CONSTANT = {"attention_mask": 0, "decoder_attention_mask": 0, "position_ids": 0,
             "decoder_position_ids": 0, "special_tokens_mask": 1}


def _power_bucket(n, limit=None):
    """The smallest power of two >= n and >= FLOOR; past limit, limit (n
    itself where n is past it too: a length the tokenizer did not expect is
    left as it is). Why FLOOR = 16: a TPU lays an array's second-last dim
    (a sequence, in [batch, length, width]) in tiles of 8 rows, 16 in bf16,
    so a shorter sequence costs about as much work as 16 there; and batches
    that short are cheap, so one program for all of them is worth their
    padding, where each length below would be a program of its own."""
    bucket = max(FLOOR, 1 << (n - 1).bit_length())
    if limit is not None and bucket > limit:
        return limit if n <= limit else n
    return bucket
