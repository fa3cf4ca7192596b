"""The tiny Llama and the character tokenizer the notebooks beside this file use: built from a config, no
Hub download, random weights (seed 0) unless a notebook trains them.

`small=True` is the size the notebooks take under HF_TPU_NOTEBOOK_SMALL=1, which is how the tests run
them on a CPU: the same code with fewer and narrower layers.
"""

from __future__ import annotations

import os
import string

# one token a character after the three special tokens: printable ASCII, space and newline, and accented
# capitals up to 128 tokens (a vocabulary that 2, 4 and 8 chips divide, for the sharding notebook)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n" + "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖØÙÚÛÜÝ"
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)


def char_tokenizer():
    """A Transformers tokenizer with one token per character (ids 3 and up) and pad/bos/eos as ids
    0/1/2; decoding joins the characters back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>")


def tiny_llama_config(small: bool = False, **overrides):
    """A Llama with grouped-query attention (4 heads, 2 key/value heads) over the character vocabulary:
    2 layers of width 64 when `small`, else 4 layers of width 256. Its weights are drawn wider than
    Llama's default (`initializer_range` 0.1, not 0.02), so that the random model's greedy text varies:
    at 0.02 the 4-layer model repeats one character."""
    from transformers import LlamaConfig

    width, layers = (64, 2) if small else (256, 4)
    settings = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                    max_position_embeddings=512, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=False)
    return LlamaConfig(**{**settings, **overrides})


def save_tiny_llama(directory: str, small: bool = False, **overrides) -> str:
    """A tiny Llama with random weights (seed 0) and its tokenizer, saved under `directory` as a
    checkpoint from the Hub would be; its folder."""
    import torch
    from transformers import LlamaForCausalLM

    path = os.path.join(directory, "tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(small, **overrides)).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
