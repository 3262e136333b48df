"""AR502 --dynamic-padding and AR503 --group-by-length: what is recognised and refused, the
padding work removed with the attention masks kept right; the training runs (losses equal to
fp32 rounding) are in test_verify.py."""

from __future__ import annotations

import ast
import runpy
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options
from tests.goldens import FIXTURES

PAD = Options.create(backend="torch", dynamic_padding=True)
FIXTURE = FIXTURES / "text_classification" / "input.py"
HEAD = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

def main(tokenizer, texts, labels):
"""


def _rewrite(body: str, options: Options = PAD):
    result = rewrite(HEAD + textwrap.indent(textwrap.dedent(body), "    "), options)
    ast.parse(result.output)
    assert rewrite(result.output, options).output == result.output, "not idempotent"
    return result


def _notes(result, code: str, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == code and n.skipped == skipped)


def test_group_by_length_needs_dynamic_padding():
    with pytest.raises(OptionError, match="--group-by-length needs --dynamic-padding"):
        Options.create(group_by_length="eval")
    with pytest.raises(OptionError, match="invalid group-by-length 'train'"):
        Options.create(dynamic_padding=True, group_by_length="train")


def test_what_dynamic_padding_leaves_alone():
    cases = {
        "is used as more than": """\
            enc = tokenizer(texts, padding="max_length", max_length=8, return_tensors="pt")
            print(enc["input_ids"].shape)
            ds = TensorDataset(enc["input_ids"], torch.tensor(labels))
            loader = DataLoader(ds, batch_size=4)
            """,
        "is used outside a DataLoader": """\
            enc = tokenizer(texts, padding=True, return_tensors="pt")
            ds = TensorDataset(enc["input_ids"], enc["attention_mask"])
            first = ds[0]
            loader = DataLoader(ds, batch_size=4)
            """,
        "already has a collate_fn": """\
            enc = tokenizer(texts, padding="max_length", return_tensors="pt")
            ds = TensorDataset(enc["input_ids"])
            loader = DataLoader(ds, batch_size=4, collate_fn=my_collate)
            """,
        "not kept in a name": """\
            ds = TensorDataset(tokenizer(texts, padding="max_length", return_tensors="pt")["input_ids"])
            """,
    }
    for why, body in cases.items():
        result = _rewrite(body)
        assert not result.changed, why
        assert why in _notes(result, "AR502", True), why


def test_the_fixture_pads_each_batch_and_groups_evaluation_by_length():
    out = rewrite(FIXTURE.read_text(), Options.create(backend="torch", dynamic_padding=True,
                                                         group_by_length="eval")).output
    assert 'train_enc = tokenizer(train_texts, truncation=True, max_length=args.max_length)\n' in out
    assert 'train_set = list(zip(train_enc["input_ids"], train_enc["attention_mask"], ' in out
    assert out.count('collate_fn=PadToLongest(tokenizer, ("input_ids", "attention_mask", None)),') == 2
    assert "sampler=sorted(range(len(val_set)), key=lambda i: len(val_set[i][0]))" in out
    assert "LengthGroupedSampler" not in out  # the training loader stays shuffled
    assert out.count("class PadToLongest:") == 1


@pytest.mark.runs
def test_padding_work_is_removed_and_the_masks_are_kept(tmp_path):
    """The rewritten fixture's own pieces: each batch is as long as its longest text, and every
    real token and mask value is the one max_length padding gave."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    script = tmp_path / "tc.py"
    script.write_text(rewrite(FIXTURE.read_text(), PAD).output)
    mod = runpy.run_path(str(script), run_name="fixture")
    tokenizer = mod["build_tokenizer"]()
    texts, labels = mod["make_reviews"](128, seed=1)
    fixed = tokenizer(texts, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
    enc = tokenizer(texts, truncation=True, max_length=64)
    dataset = list(zip(enc["input_ids"], enc["attention_mask"], torch.tensor(labels)))
    collate = mod["PadToLongest"](tokenizer, ("input_ids", "attention_mask", None))
    padded_tokens, start = 0, 0
    for input_ids, mask, y in DataLoader(dataset, batch_size=16, collate_fn=collate):
        n, length = input_ids.shape
        assert length == int(mask.sum(dim=1).max())  # as long as its longest text
        assert torch.equal(input_ids, fixed["input_ids"][start:start + n, :length])
        assert torch.equal(mask, fixed["attention_mask"][start:start + n, :length])
        assert int(fixed["attention_mask"][start:start + n, length:].sum()) == 0
        assert torch.equal(y, torch.tensor(labels[start:start + n]))
        padded_tokens += input_ids.numel()
        start += n
    assert padded_tokens < 0.75 * fixed["input_ids"].numel()
