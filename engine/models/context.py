"""A loaded model's decode context: the run-time state beside its read-only weights (llama.cpp's model vs context).

`Transformer` (engine/models/transformer.py) holds the weights and the forward pass; its `DecodeContext`,
made once per model, holds what running it decides and keeps as it goes: whether one token of one sequence
runs as one fused step (engine/fused/plan.py, built on first use, with its driver and thread choice), the
online choosers between equivalent ways of running a step (engine/tuning.py), the read-ahead settings, the
routing specs the read-ahead guesses with, and the telemetry. None of it changes an answer: only its speed.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import TYPE_CHECKING, Sequence

import numpy as np

from engine.blocks.ffn import MoE, Routing, route
from engine.blocks.linear import Probe
from engine.errors import GenerationError
from engine.fused.batch import BatchedDecode
from engine.fused.plan import FusedDecode, record
from engine.kv import KVCache
from engine.spec import MoESpec
from engine.telemetry import NULL, Telemetry
from engine.tuning import BySize, FasterChoice

if TYPE_CHECKING:
    from engine.models.transformer import Transformer


class DecodeContext:
    """The per-run state of decoding one model: settings, online choosers, the lazily built fused step."""

    def __init__(self, model: "Transformer", telemetry: Telemetry = NULL, prefetch_depth: int = 0) -> None:
        # the model owns its context: a weak reference back, so dropping the model frees its weights at once
        # (their mappings and huge pages) without waiting for the cycle collector
        self._model = weakref.ref(model)
        self.telemetry = telemetry
        self.prefetch_depth = prefetch_depth     # layers the read-ahead guesses beyond the current one (0: off)
        # experts guessed beyond top_k (None: top_k // 2): spare disk reads buy recall of the experts a layer uses
        self.lookahead_extra: int | None = None
        # one decoded token of one sequence runs as one fused parallel step when the layers allow it (the same bits
        # as the blocks one at a time); False runs the blocks
        self.fused_decode = True
        self.fused: FusedDecode | None | bool = False           # the fused step; False: not built yet, None: declined
        # whether a streamed fused step reads ahead: it costs disk time and cache slots for the guesses that miss
        # (and, where a call runs without a driver, stops), so it pays on a disk fast against the compute and not
        # on a slow one; the step times decide, as for the thread count
        self.ahead = FasterChoice()
        # several sequences' single tokens: together, or a fused step each (a choice per count of sequences)
        self.apart: BySize[FasterChoice] = BySize(FasterChoice)
        # their fused step together (engine/fused/batch.py) where the model allows it, against a fused step each
        # (`apart` measures which is faster); False: the one pass of the blocks instead
        self.batch_fused = True
        self.batched: BatchedDecode | None = None               # (None: declined or not built yet)
        self._batched_built = False
        self._guess_specs: dict[tuple[int, int], MoESpec] = {}   # (layer, experts guessed) -> the routing spec

    @property
    def model(self) -> "Transformer":
        """The model this context runs (alive as long as anything runs it)."""
        model = self._model()
        assert model is not None, "a decode context outlived its model"
        return model

    def forward_batch(
        self,
        items: Sequence[tuple[Sequence[int] | np.ndarray, KVCache]],
        *,
        all_logits: bool = False,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
        hidden: list[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Run several sequences' next tokens (see `Transformer.forward_batch`); each sequence's logits."""
        ids_list = [self.model.token_ids(tokens) for tokens, _ in items]
        caches = [cache for _, cache in items]
        if len({id(c) for c in caches}) != len(caches):
            raise GenerationError("a sequence appears twice in one batch")
        if (len(items) > 1 and routing is None and probe is None and hidden is None
                and all(i.size == 1 for i in ids_list)
                and all(self.fused_step(1, c, None) is not None for c in caches)):
            # one token of each of several sequences: one step for all (fused where the layers allow), or a fused
            # step for each, whichever measures faster at this batch size (the same bits either way)
            batched = self.batched_step(caches)
            choice = self.apart[len(items)]
            apart = choice.pick(0 if batched is not None else 1, 1 if batched is not None else 0)
            tries = self._thread_tries(batched, len(items))
            t0 = time.perf_counter()
            if apart:
                for i, c in zip(ids_list, caches):     # room for every token first (preparing again is a no-op):
                    c.prepare(i)                       # one that cannot go on fails the step before any has run
                out = [self._pass([i], [c], all_logits, None, None)[0] for i, c in zip(ids_list, caches)]
            elif batched is not None:
                out = self._batched_pass(batched, ids_list, caches)
            else:
                out = self._pass(ids_list, caches, all_logits, None, None)
            # a step that tried a thread count not chosen (either way's) is slower than the way is: not counted
            if self._thread_tries(batched, len(items)) == tries:
                choice.record(apart, time.perf_counter() - t0)
            return out
        return self._pass(ids_list, caches, all_logits, routing, probe, hidden)

    def _pass(self, ids_list: list[np.ndarray], caches: list[KVCache], all_logits: bool,
              routing: list[Routing] | None, probe: Probe | None,
              hidden: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """forward_batch's pass over validated tokens: one fused step, or the blocks for every row at once."""
        model, tel = self.model, self.telemetry
        pos_list = [cache.prepare(ids) for ids, cache in zip(ids_list, caches)]
        ids, positions = np.concatenate(ids_list), np.concatenate(pos_list)
        bounds = np.cumsum([0] + [i.size for i in ids_list])
        rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        # experts read ahead for one token only. Several at once (a prompt, a batch): the union of their guesses is
        # most of a layer's experts, read while the current layer's union still holds the cache, which ran slower
        ahead = self.prefetch_depth if model.reads_ahead and ids.size == 1 else 0
        with tel.phase("dense"):
            x = model.embed_tokens(ids)                                     # [T, hidden]
        # the fused step keeps its hidden state to itself: a pass whose hidden states are asked for runs the blocks
        fused = self.fused_step(ids.size, caches[0], probe) if hidden is None else None
        if fused is not None:
            return [self._fused_pass(fused, x, caches[0], int(positions[0]), ahead, routing)]
        n = len(model.layers)
        for j in range(min(ahead, n)):
            self.predict(j, x)

        def after_layer(i: int, xi: np.ndarray) -> None:    # read ahead `ahead` layers on from each layer's output
            if i + ahead < n:
                self.predict(i + ahead, xi)
        x = model.run_layers(x, positions, rows, caches, routing=routing, probe=probe, telemetry=tel,
                             after_layer=after_layer if ahead else None)              # [T, hidden]
        for ids_i, cache in zip(ids_list, caches):
            cache.commit(ids_i.size)
        if hidden is not None:
            hidden.append(x)                    # [T, hidden], before the final norm (an MTP drafter reads them)
        if not all_logits:
            x = x[bounds[1:] - 1]
        logits = model.head(x, probe, tel)                                  # [T or batch, V]
        if model.streamed:
            model.experts.end_token(ids.size)
        tel.end_token(ids.size, prefill=ids.size > len(caches))
        if all_logits:
            return [logits[r] for r in rows]
        return [logits[k : k + 1] for k in range(len(caches))]

    def _batched_pass(self, batched: BatchedDecode, ids_list: list[np.ndarray],
                      caches: list[KVCache]) -> list[np.ndarray]:
        """One token of each sequence as one fused step for all: each sequence's logits [1, V]."""
        model, tel = self.model, self.telemetry
        positions = np.concatenate([cache.prepare(ids.tolist()) for ids, cache in zip(ids_list, caches)])  # [B]
        with tel.phase("dense"):
            x = model.embed_tokens(np.concatenate(ids_list))                  # [B, hidden]
        logits, routes = batched.run(x, caches, positions, model.experts if model.streamed else None)   # [B, V]
        for cache in caches:
            cache.commit(1)
        if tel.enabled:
            for r in routes:
                tel.route(r.layer, r.experts)
        if model.streamed:
            model.experts.end_token(len(caches))
        tel.end_token(len(caches), prefill=False)
        return [logits[b : b + 1] for b in range(len(caches))]

    def _thread_tries(self, batched: BatchedDecode | None, n: int) -> int:
        """Steps the fused steps ran on a thread count they had not chosen, to measure it."""
        single = self.fused.tries if isinstance(self.fused, FusedDecode) else 0
        return single + (batched.tries(n) if batched is not None else 0)

    def batched_step(self, caches: list[KVCache]) -> BatchedDecode | None:
        """The fused step of one token of each of these sequences together, when the model and caches allow it."""
        if not (self.batch_fused and self.fused_decode) or self.fused_step(1, caches[0], None) is None:
            return None
        if not self._batched_built:
            assert isinstance(self.fused, FusedDecode)
            self.batched, self._batched_built = BatchedDecode.for_plan(self.fused), True
        if self.batched is None or not self.batched.accepts(caches):
            return None
        return self.batched

    def _fused_pass(self, fused: FusedDecode, x: np.ndarray, cache: KVCache, pos: int, ahead: int,
                    routing: list[Routing] | None) -> np.ndarray:
        """One token of one sequence (its embedding x [1, hidden] at `pos`) as one fused step: its logits [1, V]."""
        model, tel = self.model, self.telemetry
        if model.streamed:
            depth = self.ahead.pick(ahead, 0)
            t0 = time.perf_counter()
            for j in range(min(depth, len(model.layers))):
                self.predict(j, x)
            n = len(model.layers)

            def predict(i: int, xi: np.ndarray) -> None:   # a call stopped at layer i: read ahead from there
                if depth and i + depth < n:
                    self.predict(i + depth, xi[None])
            logits, step = fused.run(x[0], cache, pos, model.experts, predict, depth, self.lookahead_extra)
            self.ahead.record(depth, time.perf_counter() - t0)
        else:
            logits, step = fused.run(x[0], cache, pos)
        if step.attention is not None:               # as the blocks' attention hands them over, layer by layer
            for weights in step.attention:
                cache.observe(weights)
        cache.commit(1)
        record(step, tel)
        if routing is not None:
            routing.extend(step.routing())
        if model.streamed:
            model.experts.end_token(1)
        tel.end_token(1, prefill=False)
        return logits

    def fused_step(self, n_tokens: int, cache: KVCache, probe: Probe | None) -> FusedDecode | None:
        """The fused decode step when this step is one token of one sequence that it can run, else None."""
        if n_tokens != 1 or probe is not None or not self.fused_decode:
            return None
        if self.fused is False:
            self.fused = FusedDecode.for_model(self.model)
        if self.fused is None or not self.fused.accepts(cache):
            return None
        return self.fused

    def predict(self, j: int, x: np.ndarray) -> None:
        """Start reading the experts layer j's router would choose for the hidden state x [T, hidden]."""
        layer = self.model.layers[j]
        if layer is None or not isinstance(layer.ffn, MoE):
            return
        moe = layer.ffn
        h = layer.ffn_input(x, self.model.spec.rms_eps)                     # [T, hidden]
        extra = moe.spec.top_k // 2 if self.lookahead_extra is None else self.lookahead_extra
        k = min(moe.spec.n_experts, moe.spec.top_k + extra)
        spec = self._guess_specs.get((j, k))
        if spec is None:
            spec = moe.spec if k == moe.spec.top_k else dataclasses.replace(moe.spec, top_k=k)
            self._guess_specs[(j, k)] = spec
        ids, _ = route(spec, moe.router_logits(h), moe.correction_bias)       # [T, k]
        self.model.experts.prefetch(j, ids[0].tolist() if ids.shape[0] == 1 else np.unique(ids).tolist())
