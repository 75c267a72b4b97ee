"""A tiny word-level tokenizer built offline (no Hub), with pad/eos/bos and a chat template, for pipeline tests.

Its special tokens take the ids of ``tiny_models``: ``<pad>`` 0, ``</s>`` 1, ``<s>`` 2, so a ``tiny_llama`` with at
least ``len(tokenizer)`` rows in its vocabulary pairs with it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a speculative decoder drafts tokens and the target verifies them",
    "batched decoding runs many prompts at once on one machine",
    "what is the capital of france ? paris is the capital",
    "hello how are you today ? i am fine thank you",
    "user assistant system : tell me a story about a cat",
]

# Role headers on their own words, so every chat renders to plain words the tokenizer knows.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`SENTENCES` (about 60 tokens), left padding, ``<s>`` prepended."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<s>", "<unk>"])
    tokenizer.train_from_iterator(SENTENCES, trainer=trainer)
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
