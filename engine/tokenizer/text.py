"""The engine's text policy: text that is not valid Unicode is repaired, never refused.

Python strings can hold what UTF-8 cannot encode: lone surrogates (from JSON escapes such as
"\\ud800") and the surrogateescape characters U+DC80..U+DCFF that stand for undecodable bytes (in
argv, file names, `errors="surrogateescape"` streams). The Rust tokenizer refuses both, so every
text is cleaned here before it is tokenized: each invalid byte and each lone surrogate becomes one
U+FFFD, exactly as `bytes.decode("utf-8", errors="replace")` would have read the original bytes.
Valid text is returned unchanged (the same object).
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Surrogates that surrogateescape never produces (it maps bytes 0x80..0xFF to U+DC80..U+DCFF only)
_NOT_ESCAPED_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def clean_text(text: str) -> str:
    """TEXT with every lone surrogate and every escaped invalid byte replaced by U+FFFD (valid text: unchanged)."""
    if _SURROGATE.search(text) is None:
        return text
    text = _NOT_ESCAPED_BYTE.sub(REPLACEMENT, text)
    # What remains are escaped bytes: decode them as the original bytes would have been decoded with
    # errors="replace", so argv (surrogateescape) and stdin (errors="replace") give the same text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
