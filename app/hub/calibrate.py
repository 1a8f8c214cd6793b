"""Calibration text for the planner: the user's file, or text the model writes from the probes.

The default needs no data set: the model answers the probe prompts in `assets/probes/` (one topic
after another, so every topic is represented), and prompt + answer are the calibration tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from app.atlas.probes import ProbeTopic, load_probes
from engine.errors import ColibriError
from engine.generation.generate import GenerationRequest, stream_generate
from engine.generation.sampling import SamplingParams
from engine.kv import KVCache

SEQUENCE_TOKENS = 512       # a calibration file is cut into sequences this long
ANSWER_TOKENS = 48          # tokens the model writes per probe prompt


def interleaved(topics: list[ProbeTopic]) -> list[tuple[str, str]]:
    """(topic, prompt) pairs taking one prompt of each topic in turn."""
    out, i = [], 0
    while any(i < len(t.prompts) for t in topics):
        out += [(t.topic, t.prompts[i]) for t in topics if i < len(t.prompts)]
        i += 1
    return out


def calibration_sequences(model, tokenizer, stop_ids, calib_file: Path | None, n_tokens: int,
                          log: Callable[[str], None]) -> list[Sequence[int]]:
    """Token sequences adding up to about n_tokens, from a file or written by the model."""
    if tokenizer is None:
        raise ColibriError("calibration needs the model's tokenizer; this model has no tokenizer files "
                           "(use --bits without --budget or --calib)")
    if calib_file is not None:
        try:
            text = Path(calib_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ColibriError(f"--calib {calib_file}: cannot read ({exc.strerror})") from None
        ids = tokenizer.encode(text)[:n_tokens]
        if len(ids) < 16:
            raise ColibriError(f"--calib {calib_file}: only {len(ids)} tokens of text; give at least a few paragraphs")
        return [ids[i : i + SEQUENCE_TOKENS] for i in range(0, len(ids), SEQUENCE_TOKENS)]
    sequences, total = [], 0
    sampling = SamplingParams(repetition_penalty=1.1)
    for topic, prompt in interleaved(load_probes()):
        if total >= n_tokens:
            break
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.encode_chat(messages) if tokenizer.has_chat_template else tokenizer.encode(prompt)
        request = GenerationRequest(prompt=tuple(ids), max_tokens=ANSWER_TOKENS, sampling=sampling)
        cache = KVCache(model.spec, len(ids) + ANSWER_TOKENS + 1)
        done = list(stream_generate(model, tokenizer, request, stop_ids=stop_ids, cache=cache))[-1]
        seq = list(ids) + list(getattr(done, "tokens", ()))
        sequences.append(seq)
        total += len(seq)
        log(f"calibration text: {total}/{n_tokens} tokens ({topic})")
    return sequences
