"""An oracle no one here wrote: `speculators`' own EAGLE-3 model (the definition vLLM's EAGLE-3 heads come
from), converted by its own converter from specdec's export, computes the draft logits specdec computes
on the same target features and tokens, full and reduced vocabulary.

speculators lives in its own venv (it pins an older transformers): the test runs
benchmarks/peers/speculators_oracle.py through the interpreter named by SPECDEC_SPECULATORS_PYTHON (default
.venv-speculators/bin/python) and skips, naming the install line, where there is none."""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdec
from specdec.drafters import FeatureHead
from specdec.drafters.eagle_format import export_eagle3
from specdec.training.head_data import target_features

from test_feature_head import random_head

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = Path(os.environ.get("SPECDEC_SPECULATORS_PYTHON",
                                         ROOT / ".venv-speculators" / "bin" / "python"))
pytestmark = pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason=(
    f"no speculators interpreter at {SPECULATORS_PYTHON}: bash benchmarks/peers/make_speculators_venv.sh "
    ".venv-speculators (or set SPECDEC_SPECULATORS_PYTHON)"))
# float32 on both sides, the same operations in another library's order: measured 3.6e-7 of logits up to 2.4
TOLERANCE = 1e-4


def step_one_logits(head: FeatureHead, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """specdec's draft logits [T, N] of one teacher-forced step: features [T, F], tokens [T] (the next ones)."""
    with torch.no_grad():
        return head.net.logits(head.net.unroll(features[None], tokens[None], 1)[0])[0]


def speculators_logits(head: FeatureHead, target, target_dir: Path, seq: torch.Tensor, tmp_path: Path):
    """speculators' draft logits [T, N] for the head exported, over the target's features of seq [T + 1];
    also the features [T, F] and next tokens [T] it read (what step_one_logits takes)."""
    exported = export_eagle3(head.net.float(), target, tmp_path / "exported")
    features = target_features(target, seq, head.feature_layers)[:-1]
    tokens, H = seq[1:].contiguous(), target.config.hidden_size
    fused = features[:, :3 * H].float().contiguous()  # the three fused layers, in the export's order
    save_file({"features": fused, "tokens": tokens, "positions": torch.arange(len(tokens))},
              str(tmp_path / "in.safetensors"))
    subprocess.run([str(SPECULATORS_PYTHON), str(ROOT / "benchmarks/peers/speculators_oracle.py"),
                    "--head", str(exported), "--target", str(target_dir),
                    "--inputs", str(tmp_path / "in.safetensors"), "--out", str(tmp_path / "out.safetensors")],
                   check=True, capture_output=True, timeout=600)
    theirs = load_file(str(tmp_path / "out.safetensors"))
    assert theirs["converted_layer_ids"].tolist() == list(head.net.config.fused_layers)
    return theirs, features, tokens


@pytest.mark.parametrize("draft_vocab", [0, 300], ids=["full vocabulary", "reduced vocabulary"])
def test_speculators_eagle3_model_computes_specdecs_draft_logits(tmp_path, draft_vocab):
    target, tok = specdec.zoo.load("target")
    head = random_head(target, seed=3, draft_vocab=draft_vocab, arch="eagle3")
    with torch.no_grad():  # every norm its own weights, so a norm applied to the wrong half shows
        for p in head.net.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    seq = tok("def merge(left, right):\n    out = []\n    while left and right:", return_tensors="pt").input_ids[0]
    theirs, features, tokens = speculators_logits(head, target, specdec.zoo.path("target"), seq, tmp_path)
    ours = step_one_logits(head, features, tokens)
    assert theirs["logits"].shape == ours.shape == (len(tokens), draft_vocab or target.config.vocab_size)
    assert (theirs["logits"] - ours).abs().max() <= TOLERANCE
    assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))
    # power: the same comparison against a head with its two input norms swapped (the mistake a wrong name
    # map makes) fails by far
    layer = head.net.layers[0]
    with torch.no_grad():
        a, b = layer.input_layernorm.weight.clone(), layer.hidden_norm.weight.clone()
        layer.input_layernorm.weight.copy_(b)
        layer.hidden_norm.weight.copy_(a)
    assert (theirs["logits"] - step_one_logits(head, features, tokens)).abs().max() > 100 * TOLERANCE


def test_speculators_computes_the_shipped_smollm2_eagle3_heads_drafts(tmp_path):
    """The same oracle on a real target and trained weights: the shipped EAGLE-3 head over SmolLM2's own
    features of a chat turn (its fp16 weights exported in float32, what vLLM would load)."""
    name = "smollm2-135m-instruct-eagle3-head"
    if name not in specdec.zoo.heads():
        pytest.skip(f"no shipped head {name} yet")
    if specdec.zoo.status("smollm2-135m-instruct") == "not installed":
        pytest.skip("smollm2-135m-instruct is not installed: specdec zoo get smollm2-135m-instruct")
    target, tok = specdec.zoo.load("smollm2-135m-instruct")
    head = FeatureHead.from_pretrained(specdec.zoo.path(name), target)
    msgs = [{"role": "user", "content": "How do I keep basil alive on a windowsill?"}]
    seq = torch.tensor(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
    theirs, features, tokens = speculators_logits(head, target, specdec.zoo.path("smollm2-135m-instruct"), seq,
                                                  tmp_path)
    ours = step_one_logits(head, features, tokens)
    assert theirs["logits"].shape == ours.shape == (len(tokens), head.net.config.draft_vocab)
    assert (theirs["logits"] - ours).abs().max() <= TOLERANCE * max(1.0, float(ours.abs().max()))
    assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))
