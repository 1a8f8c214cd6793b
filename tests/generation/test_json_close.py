"""JsonCloser: every prefix of real JSON texts (compact, indented, escaped, nested) plus its suffix parses."""

from __future__ import annotations

import json

import pytest

from engine.generation.json_close import JsonCloser

DOCS = [{"a": [1, 2.5e3, "x\\y\"z\u00e9\n"], "b": {"c": None, "d": True, "e": False}, "f": -0.25},
        [[], {}, [{"k": "v", "n": [None, [False]]}]], {"": ""}, {"u": "\u0001"}]


@pytest.mark.parametrize("text", [f(d) for d in DOCS for f in (json.dumps, lambda d: json.dumps(d, indent=2))])
def test_every_prefix_closes_into_json(text):
    raw = text.encode()
    for i in range(1, len(raw) + 1):
        closer = JsonCloser()
        closer.feed(raw[:i])
        closed = raw[:i] + closer.suffix()
        json.loads(closed)                     # raises if the suffix does not close it
    assert JsonCloser().suffix() == b""


def test_a_pending_key_gets_null_and_whole_text_needs_nothing():
    closer = JsonCloser()
    closer.feed(b'{"name": "Ann", "age')
    assert closer.suffix() == b'":null}'
    closer.feed(b'": 3}')
    assert closer.suffix() == b""
