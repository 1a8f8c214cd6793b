"""Tokenizers for the engine: text <-> token ids, chat prompts and streaming detokenization.

Built from a Hugging Face folder (tokenizer.json and friends) or from a GGUF file's metadata.
"""

from engine.tokenizer.core import Tokenizer
from engine.tokenizer.detokenize import StreamDecoder

__all__ = ["StreamDecoder", "Tokenizer"]
