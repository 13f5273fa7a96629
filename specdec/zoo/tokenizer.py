"""Byte-level BPE tokenizer for the zoo, trained with `tokenizers`, saved so AutoTokenizer loads it."""
from __future__ import annotations

from pathlib import Path

from .corpus import EOS, read_texts


def train_tokenizer(out_dir: Path, vocab_size: int = 4096):
    """Train on the training split only; returns a PreTrainedTokenizerFast saved in out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts("train"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
