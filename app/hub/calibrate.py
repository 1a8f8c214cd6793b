"""Calibration text for the planner: the user's file, or text the model writes from the probes.

The default needs no data set: the model answers the probe prompts in `assets/probes/` (one topic
after another, so every topic is represented), and prompt + answer are the calibration tokens.
The answers are greedy (with a light repetition penalty) and decoded many prompts at a time: one
pass of the weights serves every prompt, then every answer of a wave at each step, as
`forward_batch` computes each row as it would be alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from app.atlas.probes import ProbeTopic, load_probes
from engine.errors import ColibriError
from engine.generation.prefill import PREFILL_CHUNK, prefill
from engine.generation.sampling import greedy, repetition_penalty
from engine.kv import KVCache

SEQUENCE_TOKENS = 512       # a calibration file is cut into sequences this long
ANSWER_TOKENS = 48          # tokens the model writes per probe prompt
REPETITION_PENALTY = 1.1    # keeps greedy answers from looping on one phrase
WAVE = 64                   # answers decoded together at most (their KV caches are small)
PREFILL_ROWS = 2048         # prompt tokens prefilled in one pass at most (bounds its activations)


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
    prompts = []
    for topic, prompt in interleaved(load_probes()):
        messages = [{"role": "user", "content": prompt}]
        prompts.append((topic, tokenizer.encode_chat(messages) if tokenizer.has_chat_template else tokenizer.encode(prompt)))
    sequences: list[Sequence[int]] = []
    total, k = 0, 0
    while total < n_tokens and k < len(prompts):
        # a wave of prompts whose full answers would reach n_tokens; answers that stop early leave a next wave
        wave, need = [], n_tokens - total
        while k < len(prompts) and need > 0 and len(wave) < WAVE:
            wave.append(prompts[k])
            need -= len(prompts[k][1]) + ANSWER_TOKENS
            k += 1
        for (topic, ids), answer in zip(wave, answer_greedily(model, [ids for _, ids in wave], stop_ids)):
            if total >= n_tokens:
                break
            sequences.append(list(ids) + answer)
            total += len(sequences[-1])
            log(f"calibration text: {total}/{n_tokens} tokens ({topic})")
    return sequences


def answer_greedily(model, prompts: list[Sequence[int]], stop_ids, max_tokens: int = ANSWER_TOKENS,
                    penalty: float = REPETITION_PENALTY) -> list[list[int]]:
    """Each prompt's greedy answer (up to max_tokens, without its stop token), all decoded together.

    The tokens are those of one `stream_generate` per prompt with SamplingParams(repetition_penalty=penalty):
    the prompts (those up to a prefill chunk long) take one forward pass together, then one pass per step runs
    every unfinished answer.
    """
    caches = [KVCache(model.spec, len(p) + max_tokens + 1) for p in prompts]
    rows: dict[int, np.ndarray] = {}                                                     # i -> [V]
    together: list[int] = []       # short prompts, prefilled together up to PREFILL_ROWS rows per pass
    for i, p in enumerate(prompts + [[0] * (PREFILL_ROWS + 1)]):       # a sentinel flushes the last group
        if together and (len(p) > PREFILL_CHUNK or sum(len(prompts[j]) for j in together) + len(p) > PREFILL_ROWS):
            out = model.forward_batch([(list(prompts[j]), caches[j]) for j in together])   # [1, V] each
            rows |= {j: o[-1] for j, o in zip(together, out)}
            together = []
        if i == len(prompts):
            break
        if len(p) <= PREFILL_CHUNK:
            together.append(i)
        else:
            rows[i] = prefill(model, list(p), caches[i])
    rows = dict(sorted(rows.items()))
    seen = [list(p) for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    while rows:
        going = []
        for i, row in rows.items():
            token = greedy(repetition_penalty(row, seen[i], penalty) if penalty != 1.0 else row)
            if token in stop_ids:
                continue
            answers[i].append(token)
            seen[i].append(token)
            if len(answers[i]) < max_tokens:
                going.append(i)
        if not going:
            break
        out = model.forward_batch([([answers[i][-1]], caches[i]) for i in going])             # [1, V] each
        rows = {i: o[-1] for i, o in zip(going, out)}
    return answers
