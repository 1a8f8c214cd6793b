"""Multi-token prediction (MTP) layers as a drafter for speculative decoding.

DeepSeek-V3, GLM-4.5 and GLM-5 checkpoints ship `num_nextn_predict_layers` MTP modules, numbered as
decoder layers from `num_hidden_layers` on (`model.layers.{n}.*`). For position i, with h_i the main
model's last hidden state before its final norm and t_{i+1} the token at i + 1, the first module computes

    x = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))         # [hidden]
    h_mtp = DecoderLayer(x)   (attention on the module's own KV cache, at position i)
    logits = head(shared_head.norm(h_mtp))                           # predicts t_{i+2}

(DeepSeek-V3 paper, section 2.2; the reference engines zero the embedding at position 0, and so does
this module). `embed` is the module's `embed_tokens` when the checkpoint has one, else
the main embedding; `head` is `shared_head.head`, else the main output head.

`MTPHead` holds the first module (its decoder layer as a one-layer `Transformer`, so every attention and
MoE kind the families use runs here unchanged); `MTPDrafter` follows the decode loop, feeding the module
each verified position's hidden state and token, and drafts k tokens a step by feeding its own output
hidden state back as the next position's h (what vLLM and sglang do for k > 1).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from engine.blocks.linear import linear
from engine.blocks.norm import rms_norm
from engine.errors import ColibriError
from engine.kv import KVCache
from engine.models.transformer import Transformer, expected_shapes, layer_prefix
from engine.spec import ModelSpec
from engine.weights import TensorSource, Weights


class NoMTPError(ColibriError):
    """The model has no MTP layers to draft with."""


class _Renamed:
    """A view of a checkpoint under other names: the MTP module's tensors as a one-layer model's."""

    def __init__(self, source: TensorSource, names: dict[str, str]):
        self.source, self.map, self.path = source, names, source.path

    def names(self) -> Iterable[str]:
        return list(self.map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.source.shape(self.map[name]))

    def load(self, name: str):
        return self.source.load(self.map[name])

    def location(self, name: str) -> str:
        return f"{self.source.location(self.map[name])} ({self.map[name]})"


class MTPHead:
    """The first MTP module of a checkpoint, ready to run on its own KV cache.

    `spec` is the main model's; `layer_spec` the one-layer spec of the module's decoder layer
    (`engine.models.mtp_spec`); `index` its layer number (num_hidden_layers). Tensors come from `source`,
    the checkpoint's (a container keeps them: `colibri convert`).
    """

    def __init__(self, spec: ModelSpec, layer_spec: ModelSpec, index: int, source: TensorSource):
        names = set(source.names())
        p = layer_prefix(index)

        def pick(own: str, *fallbacks: str) -> str:
            for name in (own, *fallbacks):
                if name in names:
                    return name
            return own                          # missing: Weights names it below

        mini = dataclasses.replace(layer_spec, tie_embeddings=False, lm_head_bias=False)
        mapping = {}
        for name in expected_shapes(mini):
            if name.startswith("model.layers.0."):
                mapping[name] = p + name[len("model.layers.0"):]
        mapping["model.embed_tokens.weight"] = pick(f"{p}.embed_tokens.weight", "model.embed_tokens.weight")
        mapping["model.norm.weight"] = f"{p}.shared_head.norm.weight"
        mapping["lm_head.weight"] = pick(f"{p}.shared_head.head.weight", "lm_head.weight", "model.embed_tokens.weight")
        if not any(n.startswith(p + ".") for n in names):
            raise NoMTPError(
                f"{source.path}: the config counts MTP layers but the checkpoint holds no {p}.* tensors (a container "
                "converted before MTP layers were kept, or a GGUF file): convert the model again from its Hugging "
                "Face folder, or drop --speculative mtp")
        self.spec, self.index = spec, index
        self.model = Transformer(mini, _Renamed(source, mapping))            # the decoder layer, norm and head
        h = spec.hidden_size
        w = Weights(source, {f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h)})
        self.enorm = w[f"{p}.enorm.weight"]                                   # [hidden]
        self.hnorm = w[f"{p}.hnorm.weight"]                                   # [hidden]
        self.eh_proj = w[f"{p}.eh_proj.weight"]                               # [hidden, 2 * hidden]

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for the module's decoder layer."""
        return KVCache(self.model.spec, max_len)

    def forward(self, tokens: np.ndarray, hidden: np.ndarray, cache: KVCache, origin: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
        """Run positions cache.length.. : tokens [T] (t_{i+1}) with the main hidden states [T, hidden] (h_i).

        `origin` is the sequence position of the cache's row 0. Position 0's embedding is zeroed, as the
        reference engines (vLLM, sglang) run the module. Returns
        (logits [T, V] predicting t_{i+2}, the module's output hidden states [T, hidden] before its norm,
        which stand in for h when drafting further ahead).
        """
        mini, eps = self.model, self.spec.rms_eps
        ids = mini.token_ids(tokens)
        positions = cache.prepare(ids)
        e = mini.embed_tokens(ids)                                            # [T, hidden]
        e[positions + origin == 0] = 0.0         # as vLLM and sglang run the module: position 0 reads the hidden state only
        e = rms_norm(e, self.enorm, eps)                                      # [T, hidden]
        g = rms_norm(np.ascontiguousarray(hidden, dtype=np.float32), self.hnorm, eps)   # [T, hidden]
        x = linear(np.ascontiguousarray(np.concatenate([e, g], axis=1)), self.eh_proj)  # [T, hidden]
        x = mini.run_layers(x, positions, [slice(0, ids.size)], [cache])     # [T, hidden]
        cache.commit(ids.size)
        return mini.head(x), x


def mtp_head(config: dict, source: TensorSource, spec: ModelSpec, where: str = "config.json") -> MTPHead:
    """The MTP module of a checkpoint (its config.json dict and tensors; its main model has `spec`), or
    NoMTPError saying why there is none (`engine.loader.load_mtp` opens one by path)."""
    from engine.models import mtp_spec

    layer_spec = mtp_spec(config, where)
    if layer_spec is None:
        raise NoMTPError(f"{where}: this {spec.architecture} checkpoint has no MTP layers (num_nextn_predict_layers "
                         "is 0 or absent, or the family has none); --speculative mtp needs a DeepSeek-V3, GLM-4.5 or "
                         "GLM-5 checkpoint that ships them: use --speculative (prompt lookup) instead")
    return MTPHead(spec, layer_spec, spec.n_layers, source)


class MTPDrafter:
    """A `HiddenStateDrafter`: drafts with an MTP head that follows the decode loop's verified hidden states.

    The loop calls `observe(start, hidden)` with the main model's hidden states [T, hidden] of context
    positions start.. after each verified pass (and the prompt's after prefill); `propose(context, k)` then
    runs the module over the positions it has not seen (each needs its next token, so the context's last
    token's position waits for the next pass) and drafts up to k greedy tokens, feeding its own hidden
    state back after the first. Its cache holds only verified positions between calls.

    Positions count from the prompt's first token. When the loop skips hidden states (plain fused steps
    while drafting is switched off), the module restarts at the first position it sees again: its cache
    then begins there (RoPE only sees offsets within it), and it drafts again one pass later.
    """

    def __init__(self, head: MTPHead, max_len: int | None = None):
        self.head = head
        self.cache = head.new_cache(max_len)
        self.offset = 0                          # context position of the module's cache row 0
        self.verified = 0                        # cache rows computed from verified tokens and hidden states
        self.start = 0                           # context position of self.hidden[0]
        self.hidden: list[np.ndarray] = []       # main hidden states [hidden] of positions start.., not yet run

    def observe(self, start: int, hidden: np.ndarray) -> None:
        """Main-model hidden states [T, hidden] of context positions start..start + T - 1 (replacing any held
        from `start` on)."""
        if start < self.offset + self.verified:  # a rewound context: the module's cache follows it back
            self.verified = max(start - self.offset, 0)
        if start < self.start:
            self.hidden, self.start = [], start
        del self.hidden[start - self.start:]
        if start > self.start + len(self.hidden):   # positions missed: restart the module's cache here
            self.offset, self.verified, self.hidden, self.start = start, 0, [], start
        self.hidden.extend(np.asarray(hidden, dtype=np.float32))

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to k greedy MTP tokens after `context` [m + 1] (whose positions up to m - 1 have been observed)."""
        ctx = np.asarray(context, dtype=np.int64)
        m = ctx.size - 1                         # the last token's position: its hidden state comes next pass
        cache = self.cache
        cache.truncate(self.verified)            # drop last call's own-output rows
        lo = self.offset + self.verified         # the first position the module has not run
        if k < 1 or lo >= m or lo < self.start or m > self.start + len(self.hidden) \
                or m - self.offset + k >= cache.max_len:
            return []                            # nothing asked, nothing new, or hidden states missing
        rows = np.stack(self.hidden[lo - self.start : m - self.start])         # [m - lo, hidden]
        logits, out = self.head.forward(ctx[lo + 1 : m + 1], rows, cache, origin=self.offset)
        logits, out = logits[-1], out[-1]
        self.verified = m - self.offset
        del self.hidden[: m - self.start]        # consumed: later positions come from later passes
        self.start = m
        draft: list[int] = []
        vocab = self.head.spec.vocab_size
        while True:
            token = int(np.argmax(logits))
            if token >= vocab:
                return draft
            draft.append(token)
            if len(draft) == k:
                return draft
            step, hid = self.head.forward(np.array([token]), out[None], cache, origin=self.offset)   # own state as h
            logits, out = step[-1], hid[-1]

    def close(self) -> None:
        """Give the module's cache blocks back."""
        self.cache.release()
