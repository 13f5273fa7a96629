"""The engine reads the device once per step: the verification result (path, next token, beta in one
transfer). A draft comes with its HostCopy (every built-in drafter builds it on the host), so the step is
planned without reading it back; only a drafter that returns device tensors alone costs a second read
(check_draft, one transfer). Anything more stalls a GPU's queue every step. Counted with a TorchFunctionMode, which sees every
tensor-to-host read (tolist, item, int(), float(), bool(), nonzero, cpu, equal) wherever it happens;
the drafter's own drafting (its business, not the loop's) is left out of the count."""
import collections
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

import specdec
from specdec.engine import Engine

from conftest import build

READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy", "equal"}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.paused = 0
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(monkeypatch, sample: bool, strip_host: bool = False, **options) -> tuple[list[int], torch.Tensor]:
    target = build("llama", seed=0)
    ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    model = specdec.wrap(target, **options)
    drafter = model.engine.drafter
    mode, counts = CountReads(), []

    def outside_the_count(method):
        def run(*a, **k):
            mode.paused += 1
            try:
                draft = method(*a, **k)
            finally:
                mode.paused -= 1
            return dataclasses.replace(draft, host=None) if strip_host else draft
        return run

    for name in ("propose", "propose_tree"):
        monkeypatch.setattr(drafter, name, outside_the_count(getattr(drafter, name)))
    step = Engine._step

    def counted(self, *a, **k):
        mode.count = 0
        with mode:
            done = step(self, *a, **k)
        counts.append(mode.count)
        return done

    monkeypatch.setattr(Engine, "_step", counted)
    out = model.generate(ids, max_new_tokens=24, eos_token_id=None, do_sample=sample)
    return counts, out


@pytest.mark.parametrize("options", [
    dict(drafter="ngram", draft_length=3),
    dict(drafter="draft", draft_length=3),
    dict(drafter="draft", draft_length=3, sample=True),
    dict(drafter="draft", tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2)),
    dict(drafter="draft", tree=specdec.TreeSpec.static([2, 1])),
], ids=["ngram", "model chain", "model chain sampled", "dynamic tree", "static tree"])
def test_the_engine_reads_the_device_once_per_step(monkeypatch, options):
    options = dict(options)
    sample = options.pop("sample", False)
    if options["drafter"] == "draft":
        options["drafter"] = build("llama", seed=1, layers=1)
    counts, _ = reads_per_step(monkeypatch, sample, **options)
    assert len(counts) > 3 and max(counts) <= 1, collections.Counter(counts)


def test_a_draft_without_its_host_copy_is_read_once_and_decodes_the_same(monkeypatch):
    """A third-party drafter may return device tensors only: one more read (check_draft), same output."""
    with_copy, out = reads_per_step(monkeypatch, False, drafter="ngram", draft_length=3)
    monkeypatch.undo()
    without, out_stripped = reads_per_step(monkeypatch, False, strip_host=True, drafter="ngram", draft_length=3)
    assert max(with_copy) <= 1 and max(without) == 2, (collections.Counter(with_copy), collections.Counter(without))
    assert torch.equal(out, out_stripped)


def test_a_host_copy_that_disagrees_with_its_tensors_is_refused():
    from specdec.drafters.base import Draft, check_draft

    draft = Draft.from_lists([5, 6], None, "cpu")
    draft.host.tokens.append(7)
    with pytest.raises(ValueError, match="HostCopy"):
        check_draft(object(), draft, 4, 100)
