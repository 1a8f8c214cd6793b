"""Texts and a tiny SentencePiece-style GGUF vocabulary shared by the tokenizer and detokenizer tests."""

from __future__ import annotations

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we've won, they'll see, I'd say.",
    "Ça déjà vu? L'élève a mangé une crème brûlée à Noël.",
    "Grüße aus München: Straße, Äpfel, Übermaß.",
    "Привет, мир! Как дела?",
    "你好，世界。今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}\n",
    "if (a && b) {\n\tprintf(\"%d\\n\", a[i]);\n}\n",
    "pi = 3.14159; n = 1234567; big = 12345678901234567890",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 heart ❤️",
    "spaces   between    words\t\ttabs\n\n\nnewlines \r\n crlf   ",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "",
    " ",
    "\n",
    "a",
    "I'M SHOUTING, YOU'RE NOT. 'quoted' “curly” — dash… ellipsis",
]


SP = "\u2581"
TINY_PIECES = [SP, "e", "h", "l", "o", "w", "r", "d", "t", "a", "c", "s", "i", "n", ",", "!", "é",
               SP + "h", "he", "ll", "lo", "llo", SP + "he", "hell", SP + "hello", SP + "w", "or", SP + "wor",
               "ld", SP + "world", SP + "t", "at", SP + "c", SP + "cat", "ca", SP + "is", "is", SP + "a", "in",
               SP + "in", SP + SP, SP + SP + SP, "té"]


def tiny_llama_metadata(**overrides) -> dict:
    """GGUF metadata of a tiny "llama" tokenizer: <unk> <s> </s>, 256 byte tokens, then scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + TINY_PIECES
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(TINY_PIECES),
        # Earlier pieces score higher, so they merge first (as SentencePiece BPE orders them)
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(TINY_PIECES))],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }
    meta.update(overrides)
    return meta
