"""Tokenizers for the engine: text <-> token ids, chat prompts and streaming detokenization.

Built from a Hugging Face folder (tokenizer.json and friends) or from a GGUF file's metadata.
Text that is not valid Unicode (lone surrogates, undecodable bytes) is repaired with U+FFFD, never
refused: `clean_text` is applied wherever text enters a tokenizer.
"""

from engine.tokenizer.core import Tokenizer
from engine.tokenizer.detokenize import StreamDecoder
from engine.tokenizer.text import clean_text

__all__ = ["StreamDecoder", "Tokenizer", "clean_text"]
