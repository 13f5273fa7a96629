"""An oracle no one here wrote: `speculators`' own EAGLE-3 model computes the draft logits of a head that
specdec exported, on features and tokens the caller gives.

Runs in speculators' own virtual environment (benchmarks/peers/make_speculators_venv.sh: speculators pins
an older transformers than specdec's tests use), so it imports nothing from specdec. Steps, all
speculators' code: its converter (`speculators.convert.eagle.Eagle3Converter`, the path a user takes
from an EAGLE-3 checkpoint in vLLM's / SpecForge's layout to speculators' format) turns the export into
a speculators checkpoint, with the export's fused layer ids; `Eagle3DraftModel.from_pretrained` loads it
(the embedding from the target's own weights, as speculators does); one step of its training forward
(`ttt_steps=1`: fc over the three fused layers, the midlayer over [embedding | hidden] under a causal
mask, norm, its draft LM head) gives the logits, read off its `lm_head`. (One detour from the plain
path, named where it is taken: the embedding is loaded explicitly, see below.)

    python speculators_oracle.py --head EXPORTED --target TARGET_DIR --inputs IN.safetensors --out OUT.safetensors

IN holds `features` [T, 3H] float32 (the three fused layers side by side, in the export's layer order),
`tokens` [T] int64 (the token after each position) and `positions` [T] int64; OUT gets `logits` [T, N]
float32 (N: the draft vocabulary) and `converted_layer_ids` [3] int64 (what speculators' config recorded).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="a folder specdec export-head wrote (vLLM's EAGLE-3 layout)")
    ap.add_argument("--target", required=True, help="the target's HF folder (speculators reads its config and embedding)")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel

    layer_ids = json.loads((Path(a.head) / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp) / "speculators"
        Eagle3Converter().convert(a.head, converted, base_model=a.target, validate=True,
                                  eagle_aux_hidden_state_layer_ids=layer_ids)
        model = Eagle3DraftModel.from_pretrained(str(converted), torch_dtype=torch.float32)
    # The embedding, from the target's weights, by speculators' own loader. Its default call loads it only
    # where the parameter is NaN ("uninitialized"), but under transformers 5.19 from_pretrained leaves a
    # parameter missing from the checkpoint as uninitialised memory, not NaN: the draft then embeds with
    # whatever that memory held (seen here: logits off by 1-3 % or 1e32, a different amount every process).
    model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001
    model.config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 (flex attention is CUDA-first)
    model._attn_impl = "eager"  # noqa: SLF001
    from speculators.models.attention import create_float_mask
    model._create_mask_fn = create_float_mask  # noqa: SLF001
    model = model.float().eval()

    x = load_file(a.inputs)
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    T = x["tokens"].numel()
    with torch.no_grad():
        model(hidden_states=x["features"][None].float(), input_ids=x["tokens"][None].long(),
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=x["positions"][None].long(),
              ttt_steps=1)
    hook.remove()
    save_file({"logits": seen[0][0].float().contiguous(),
               "converted_layer_ids": torch.tensor(list(model.config.eagle_aux_hidden_state_layer_ids or []),
                                                   dtype=torch.long)}, a.out)


if __name__ == "__main__":
    main()
