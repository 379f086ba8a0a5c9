"""A character-level tokenizer for tiny-lm, trained on the generated corpus with ``tokenizers``.

One token per character (spaces included), so every answer's length in tokens is its length
in characters and decoding gives back the exact text. ``<s>`` is prepended to encoded text;
``</s>`` ends an answer; ``<pad>`` pads a batch; ``<unk>`` stands for a character the corpus
never had. Wrapped as a ``PreTrainedTokenizerFast``: ``save_pretrained`` writes a folder
that ``AutoTokenizer.from_pretrained`` loads back offline, beside the model.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order


def train_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over every character in ``texts`` (deterministic ids: specials, then sorted)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join tokens as they are: no space between characters
    # WordLevel's trainer sorts by frequency; a fixed alphabet order gives the same ids for any corpus order
    chars = sorted({c for text in texts for c in text})
    if not chars:
        raise ValueError("no text to train the tokenizer on")
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=0, show_progress=False)
    tok.train_from_iterator(chars, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos_id)]
    )
    missing = [c for c in chars if tok.token_to_id(c) is None]
    if missing:
        raise RuntimeError(f"tokenizer training dropped characters {missing!r}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
