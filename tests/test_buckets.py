"""Host batches padded to buckets before upload (torchtpu/buckets.py): which
lengths, which fields and with what, where batches are left as they are, the
switch; a BERT fine-tuned on lengths 17..128 through DeviceLoader compiles a
set of programs per bucket, not per length. Exactness against CPU with real
models, Trainer and Accelerate: tests/test_buckets_hf.py."""
import warnings

import pytest
import torch
from hf_batches import PAD, bert_classifier, examples, tokenizer
from torch.utils.data import DataLoader

import torchtpu
from torchtpu.buckets import Bucketer, _power_bucket, lengths_from
from torchtpu.data import DeviceLoader

transformers = pytest.importorskip("transformers")


def _padded(bucketer, *batches):
    return list(bucketer.padded(iter(batches)))


def _t(rows):
    return torch.tensor(rows)


def test_default_buckets_are_powers_of_two_from_16_within_the_tokenizers_limit():
    assert [_power_bucket(n) for n in (1, 16, 17, 32, 33, 100, 128, 129, 1000)] == \
        [16, 16, 32, 32, 64, 128, 128, 256, 1024]
    # A tokenizer's model_max_length is the last bucket; past it, as it is.
    assert [_power_bucket(n, 77) for n in (17, 40, 70, 77, 80)] == [32, 64, 77, 77, 80]
    lengths = range(17, 129)
    assert {_power_bucket(n) for n in lengths} == {32, 64, 128}
    loader = DataLoader([], collate_fn=transformers.DataCollatorWithPadding(
        tokenizer(model_max_length=100)))
    assert Bucketer(True, loader=loader).limit == 100
    assert Bucketer(True, loader=DataLoader([], collate_fn=transformers.DataCollatorWithPadding(
        tokenizer()))).limit is None  # no limit given: int(1e30)


def test_the_switch_and_a_list_of_lengths(monkeypatch):
    assert lengths_from(True) == "powers of two"
    assert lengths_from(None) is None and lengths_from(False) is None
    assert lengths_from([128, 32, 64, 32]) == (32, 64, 128)
    monkeypatch.delenv("TORCHTPU_BUCKETS", raising=False)
    assert lengths_from("auto") == "powers of two"  # on by default
    for off in ("off", "0", "false", "no"):
        monkeypatch.setenv("TORCHTPU_BUCKETS", off)
        assert lengths_from("auto") is None
    monkeypatch.setenv("TORCHTPU_BUCKETS", "64, 32")
    assert lengths_from("auto") == (32, 64)
    monkeypatch.setenv("TORCHTPU_BUCKETS", "short")
    with pytest.raises(ValueError, match="TORCHTPU_BUCKETS must be on, off or a comma list"):
        lengths_from("auto")
    with pytest.raises(ValueError, match="buckets must be 'auto', True"):
        DeviceLoader([], buckets="pow2")
    with pytest.raises(TypeError, match="buckets must be 'auto', True, None, False or a list"):
        DeviceLoader([], buckets=64)
    for bad in ([], [0, 32], [32.0], [True]):
        with pytest.raises(ValueError, match="non-empty list of positive ints"):
            DeviceLoader([], buckets=bad)
    with pytest.raises(TypeError, match="pad_values must be a dict"):
        DeviceLoader([], pad_values=[("input_ids", 0)])
    with pytest.raises(TypeError, match="expected a field name and a number"):
        DeviceLoader([], pad_values={"input_ids": "0"})


def test_a_list_of_lengths_pads_to_the_next_and_leaves_longer_batches():
    b = Bucketer([8, 12])
    batches = [{"input_ids": torch.full((2, n), 7), "attention_mask": torch.ones(2, n, dtype=torch.long)}
               for n in (3, 9, 12, 14)]
    batches[0]["attention_mask"][1, -1] = 0  # shows the side (right)
    with pytest.warns(UserWarning, match="length 14 is longer than the largest bucket"):
        out = _padded(b, *batches)
    assert [x["input_ids"].shape[1] for x in out] == [8, 12, 12, 14]
    assert out[3] is batches[3] and out[2] is batches[2]


def test_each_hugging_face_field_is_padded_as_its_collator_pads_it():
    tok = tokenizer()
    tok._pad_token_type_id = 2  # (BERT's is 0; shows that the tokenizer's is used)
    collator = transformers.DataCollatorForTokenClassification(tok, label_pad_token_id=-7)
    b = Bucketer(True, loader=DataLoader([], collate_fn=collator))
    batch = transformers.BatchEncoding({
        "input_ids": _t([[5, 6, 7], [8, 9, PAD]]), "attention_mask": _t([[1, 1, 1], [1, 1, 0]]),
        "token_type_ids": _t([[0, 1, 1], [0, 0, 2]]), "special_tokens_mask": _t([[1, 0, 1], [1, 1, 1]]),
        "position_ids": _t([[0, 1, 2], [0, 1, 0]]), "labels": _t([[1, 2, 3], [4, 5, -7]]),
        "idx": _t([10, 11]), "text": ["a b c", "d e"]})
    (out,) = _padded(b, batch)
    assert type(out) is transformers.BatchEncoding and out["text"] == ["a b c", "d e"]
    expect = {"input_ids": ([[5, 6, 7], [8, 9, PAD]], PAD),
              "attention_mask": ([[1, 1, 1], [1, 1, 0]], 0),
              "token_type_ids": ([[0, 1, 1], [0, 0, 2]], 2),
              "special_tokens_mask": ([[1, 0, 1], [1, 1, 1]], 1),
              "position_ids": ([[0, 1, 2], [0, 1, 0]], 0),
              "labels": ([[1, 2, 3], [4, 5, -7]], -7)}
    for name, (rows, value) in expect.items():
        want = torch.tensor([r + [value] * 13 for r in rows])
        torch.testing.assert_close(out[name], want, rtol=0, atol=0, msg=name)
    assert out["idx"] is batch["idx"]  # not a per-token field: as it is
    assert batch["input_ids"].shape == (2, 3)  # the loader's batch is not changed


def test_left_padding_is_kept_and_needs_position_ids():
    tok = tokenizer(padding_side="left")
    b = Bucketer(True, loader=DataLoader([], collate_fn=transformers.DataCollatorWithPadding(tok)))
    # GPT-2 would see the true tokens at other positions:
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": _mask(n).flip(1)},
                "left-padded batches without position_ids", b)
    batch = {"input_ids": _t([[5, 6], [PAD, 7]]), "attention_mask": _t([[1, 1], [0, 1]]),
             "labels": _t([[5, 6], [-100, 7]])}
    batch["position_ids"] = _t([[0, 1], [0, 0]])
    (out,) = _padded(b, batch)
    torch.testing.assert_close(out["input_ids"], _t([[PAD] * 14 + [5, 6], [PAD] * 15 + [7]]))
    torch.testing.assert_close(out["attention_mask"][1], _t([0] * 15 + [1]))
    torch.testing.assert_close(out["labels"][0], _t([-100] * 14 + [5, 6]))


def _left_alone(make, match=None, bucketer=None):
    """Batches make(3) and make(4) come out of a Bucketer as they went in;
    the warning that says why (match) comes once lengths vary (at the
    second), and none where match is None."""
    b = bucketer or Bucketer(True)
    first, second = make(3), make(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _padded(b, first)[0] is first
        assert not seen  # batches of one length need no bucket: nothing to say yet
        assert _padded(b, second)[0] is second
        third = make(5)
        assert _padded(b, third)[0] is third  # (and no second warning)
    messages = [str(w.message) for w in seen]
    if match is None:
        assert not messages
    else:
        assert len(messages) == 1 and match in messages[0], messages


def _ids(n):
    return torch.arange(5, 5 + 2 * n).reshape(2, n)


def _mask(n):
    return torch.cat([torch.ones(2, n - 1, dtype=torch.long), _t([[1], [0]])], 1)


def test_batches_are_left_as_they_are_where_padding_is_not_known_to_be_exact():
    # The model would attend to the added pads:
    _left_alone(lambda n: {"input_ids": _ids(n)}, "no attention_mask")
    # Not a mapping: no names to go by.
    _left_alone(lambda n: (_ids(n), _mask(n)))
    # What a padded position of another field holds is the model's business:
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": _mask(n),
                           "weights": torch.ones(2, n)}, "field 'weights' of shape (2, 4)")
    _left_alone(lambda n: {"inputs_embeds": torch.ones(2, n, 4), "attention_mask": _mask(n)},
                "field 'inputs_embeds'")
    # Float labels: -100 would be a target.
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": _mask(n),
                           "labels": torch.ones(2, n)}, "field 'labels'")
    # Rows padded on both sides, masks of other values (packed sequences).
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": torch.stack([_mask(n)[1].flip(0),
                                                                               _mask(n)[1]])})
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": _mask(n) * 2})
    # On a device already: padded (or not) by whoever put it there.
    _left_alone(lambda n: {"input_ids": _ids(n).to("tpu"), "attention_mask": _mask(n).to("tpu")})


def test_pad_values_name_other_fields():
    ids, mask = _t([[5, 6, 7], [8, 9, 3]]), _t([[1, 1, 1], [1, 1, 0]])
    b = Bucketer(True, pad_values={"weights": 0.0, "input_ids": 4, "pixel_values": None})
    batch = {"input_ids": ids, "attention_mask": mask, "weights": torch.ones(2, 3),
             "pixel_values": torch.ones(2, 3, 3)}
    (out,) = _padded(b, batch)
    assert out["pixel_values"] is batch["pixel_values"]
    torch.testing.assert_close(out["weights"], torch.cat([torch.ones(2, 3), torch.zeros(2, 13)], 1))
    torch.testing.assert_close(out["input_ids"][:, 3:], torch.full((2, 13), 4))  # not the batch's 3


def test_the_pad_id_without_a_tokenizer_is_the_one_the_batch_shows():
    b = Bucketer(True)  # a collate_fn of the user's: no tokenizer to ask
    full = {"input_ids": _t([[5, 6], [7, 8]]), "attention_mask": _t([[1, 1], [1, 1]])}
    assert _padded(b, full)[0] is full  # no padding: neither its side nor its pad id shows
    padded = {"input_ids": _t([[5, 6, 7], [8, 9, 50]]), "attention_mask": _t([[1, 1, 1], [1, 1, 0]])}
    out = _padded(b, padded, full)
    assert out[0]["input_ids"][1].tolist() == [8, 9] + [50] * 14
    assert out[1]["input_ids"][0].tolist() == [5, 6] + [50] * 14  # as the batches before showed
    b = Bucketer(True, loader=DataLoader([], collate_fn=lambda x: x))
    b.side = "right"  # known, and the pad id not
    _left_alone(lambda n: {"input_ids": _ids(n), "attention_mask": torch.ones(2, n, dtype=torch.long)},
                "pad id is not known", b)


def test_seq2seq_labels_are_padded_to_a_bucket_of_their_own():
    collator = transformers.DataCollatorForSeq2Seq(tokenizer())
    loader = DataLoader(examples([20], 2, label=False, target=[40]), batch_size=2, collate_fn=collator)
    (batch,) = loader
    (out,) = _padded(Bucketer(True, loader=loader), batch)
    assert batch["input_ids"].shape[1] == 20 and batch["labels"].shape[1] == 40
    assert out["input_ids"].shape[1] == 32 and out["labels"].shape[1] == 64
    torch.testing.assert_close(out["labels"][:, :40], batch["labels"], rtol=0, atol=0)
    assert (out["labels"][:, 40:] == -100).all() and (out["attention_mask"][:, 20:] == 0).all()


def test_a_collator_padding_to_max_length_is_left_alone():
    collator = transformers.DataCollatorWithPadding(tokenizer(), padding="max_length", max_length=20)
    loader = DataLoader(examples([9], 2), batch_size=2, collate_fn=collator)
    (batch,) = DeviceLoader(loader)
    assert batch["input_ids"].shape == (2, 20)


def test_device_loader_buckets_by_default_and_the_switch_turns_it_off(monkeypatch):
    loader = DataLoader(examples([20, 33, 64, 70], 4), batch_size=4,
                        collate_fn=transformers.DataCollatorWithPadding(tokenizer()))
    monkeypatch.delenv("TORCHTPU_BUCKETS", raising=False)
    assert [b["input_ids"].shape[1] for b in DeviceLoader(loader)] == [32, 64, 64, 128]
    assert [b["input_ids"].shape[1] for b in DeviceLoader(loader, buckets=[40, 80])] == [40, 40, 80, 80]
    for off in (None, False):
        assert [b["input_ids"].shape[1] for b in DeviceLoader(loader, buckets=off)] == [20, 33, 64, 70]
    fed = DeviceLoader(loader)
    monkeypatch.setenv("TORCHTPU_BUCKETS", "off")  # read at each epoch
    assert [b["input_ids"].shape[1] for b in fed] == [20, 33, 64, 70]
    plain = list(loader)
    for got, want in zip(DeviceLoader(loader, buckets=True), plain):
        assert got["input_ids"].device.type == "tpu"
        n = want["input_ids"].shape[1]
        torch.testing.assert_close(got["input_ids"].cpu()[:, :n], want["input_ids"], rtol=0, atol=0)
        assert (got["attention_mask"].cpu()[:, n:] == 0).all()
        torch.testing.assert_close(got["labels"].cpu(), want["labels"], rtol=0, atol=0)


def _compilations():
    torchtpu.wait_for_compiles()
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


@pytest.mark.parametrize("eager", ["strict", "fused"])
def test_lengths_17_to_128_compile_a_set_of_programs_per_bucket(eager):
    """A BERT fine-tuned through DeviceLoader with dynamic padding: after
    three batches of each bucket (32, 64, 128; fused mode compiles a graph
    the second time it meets it), 11 batches of 11 other lengths in 17..128
    (each bucket's edges among them) compile nothing."""
    first = [20, 50, 100, 30, 60, 112, 22, 39, 91]
    later = [17, 128, 33, 64, 65, 32, 97, 18, 57, 127, 36]
    assert len(set(first + later)) == 20
    collator = transformers.DataCollatorWithPadding(tokenizer())
    loader = DataLoader(examples(first + later, 4), batch_size=4, collate_fn=collator)
    torch.manual_seed(0)
    model = bert_classifier(layers=1).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes, compiled = [], []
    with torchtpu.eager_mode(eager):
        for step, batch in enumerate(DeviceLoader(loader)):
            shapes.append(batch["input_ids"].shape[1])
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            if step == len(first) - 1:
                compiled.append(_compilations())
        compiled.append(_compilations())
    assert shapes[:9] == [32, 64, 128] * 3 and set(shapes) == {32, 64, 128}
    assert compiled[1] == compiled[0], f"{compiled[1] - compiled[0]} compilations after the warm-up"
