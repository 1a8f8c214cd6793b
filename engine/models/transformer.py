"""The decoder-only transformer every family shares: embed, N x (attention + feed-forward), norm, head.

A family module only turns its config into a `ModelSpec`; this module knows tensor names
(Hugging Face's), checks them against the spec, and runs the forward pass on a `KVCache`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from engine.blocks.attention import Attention, attention_shapes
from engine.blocks.ffn import (
    MLP, ExpertSource, ExpertWeights, MoE, ResidentExperts, Routing, StreamingExpertSource, mlp_shapes, route,
)
from engine.blocks.linear import Probe, linear
from engine.blocks.mla import LatentAttention, mla_shapes
from engine.blocks.norm import rms_norm
from engine.blocks.rope import Rotary
from engine.errors import GenerationError
from engine.kv import KVCache
from engine.fused.plan import FusedDecode, record
from engine.tuning import FasterChoice
from engine.spec import AttentionSpec, LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec
from engine.telemetry import NULL, Telemetry
from engine.weights import TensorSource, Weights


class LayerSource(Protocol):
    """Where streamed decoder layers come from (engine.offload.layers.LayerStore)."""

    def streams(self, i: int) -> bool:
        """Whether layer i is streamed rather than held."""

    def bind(self, build: Callable[[int, TensorSource], "Layer"]) -> None:
        """The function that builds layer i over a source holding its tensors."""

    def layer(self, i: int) -> "Layer":
        """Layer i, in memory until the next call (reads of the following layers start here)."""


def layer_prefix(i: int) -> str:
    """The tensor name prefix of decoder layer i."""
    return f"model.layers.{i}"


def expert_prefix(i: int, moe: MoESpec, expert: int) -> str:
    """The tensor name prefix of routed expert `expert` in layer i."""
    return f"{layer_prefix(i)}.{moe.prefix}.experts.{expert}"


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with the shape its spec implies."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i, layer in enumerate(spec.layers):
        p = layer_prefix(i)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if isinstance(layer.attn, MLASpec):
            shapes |= mla_shapes(layer.attn, f"{p}.self_attn", h)
        else:
            shapes |= attention_shapes(layer.attn, f"{p}.self_attn", h)
        ffn = layer.ffn
        if isinstance(ffn, MLPSpec):
            shapes |= mlp_shapes(f"{p}.{ffn.prefix}", h, ffn.intermediate)
            continue
        shapes[f"{p}.{ffn.prefix}.gate.weight"] = (ffn.n_experts, h)
        if ffn.correction_bias:
            shapes[f"{p}.{ffn.prefix}.gate.e_score_correction_bias"] = (ffn.n_experts,)
        for e in range(ffn.n_experts):
            shapes |= mlp_shapes(expert_prefix(i, ffn, e), h, ffn.expert_ffn, ffn.proj_names)
        if ffn.shared_ffn:
            shapes |= mlp_shapes(f"{p}.{ffn.prefix}.{ffn.shared_prefix}", h, ffn.shared_ffn)
        if ffn.shared_gate:
            shapes[f"{p}.{ffn.prefix}.shared_expert_gate.weight"] = (1, h)
    return shapes


def embed_rows(embed, ids: np.ndarray) -> np.ndarray:
    """The embedding rows of `ids` as float32 [T, hidden], from a float or a quantized table."""
    if isinstance(embed, np.ndarray):
        return np.array(embed[ids], dtype=np.float32)
    return embed.rows(ids)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's blocks."""

    input_norm: np.ndarray        # [hidden]
    attn: Attention | LatentAttention
    post_norm: np.ndarray         # [hidden]
    ffn: MLP | MoE


class Transformer:
    """A decoder-only model ready to run: read-only weights plus the forward pass.

    Routed experts come from `experts` when given (a streaming store: the checkpoint's experts are then
    never touched here), else they are held resident. With a store that reads ahead (`prefetch`),
    the router of layer i + D applied to the hidden state after layer i predicts that layer's experts.
    """

    def __init__(
        self,
        spec: ModelSpec,
        source: TensorSource,
        experts: ExpertSource | None = None,
        on_layer: Callable[[int, int], None] | None = None,
        telemetry: Telemetry = NULL,
        prefetch_depth: int = 0,
        layers: "LayerSource | None" = None,
    ):
        self.spec = spec
        self.telemetry = telemetry
        self.prefetch_depth = prefetch_depth
        # experts predicted beyond top_k (None: top_k // 2): on mixtral-1.7b one layer ahead, top-8 predicted
        # 67% of the experts used, top-12 79% (at 53% precision); spare disk reads buy recall
        self.lookahead_extra: int | None = None
        self._guess_specs: dict[tuple[int, int], object] = {}   # (layer, experts guessed) -> the routing spec
        self.streamed = experts is not None
        self.reads_ahead = isinstance(experts, StreamingExpertSource)   # declared once: the check is not free
        self.layer_source = layers
        w = Weights(source, expected_shapes(spec))
        self.embed = w["model.embed_tokens.weight"]                          # [V, hidden]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if spec.tie_embeddings else w["lm_head.weight"]  # [V, hidden]
        rotaries: dict = {}
        self.layers: list[Layer | None] = []     # None: a streamed layer, built from the layer source per use
        resident: dict[int, list[ExpertWeights]] = {}
        for i, ls in enumerate(spec.layers):
            streamed = layers is not None and layers.streams(i)
            self.layers.append(None if streamed else self._load_layer(i, ls, w, rotaries, resident))
            if on_layer is not None:
                on_layer(i, spec.n_layers)
        self._rotaries = rotaries
        self.experts: ExpertSource = experts if experts is not None else ResidentExperts(resident)
        if layers is not None:
            layers.bind(self._build_layer)
        # one decoded token of one sequence runs as one fused parallel step when the layers allow it
        # (engine/fused/plan.py: the same bits as the blocks one at a time); False runs the blocks
        self.fused_decode = True
        self._fused: FusedDecode | None | bool = False           # False: not built yet
        # whether a fused decode step reads ahead: it costs disk time and cache slots for the guesses that miss
        # (and, where a call runs without a driver, stops: a call ends wherever a guessed expert is not in
        # memory). Measured on mixtral-1.7b here (disk 1-1.6 GB/s) with stops, it decoded slower than reading on
        # demand with the dense part plus 10% of the experts in memory (cold 16-17 and warm 17-20 tok/s against
        # 18-19 and 22-23) and plus 25% (41-46 and 39-50 against 57-58 and 54-62); on a disk fast against the
        # compute it pays. So the step times decide, as for the thread count.
        self._ahead = FasterChoice()
        self._apart = FasterChoice()    # several sequences' single tokens: one pass, or a fused step each

    def _build_layer(self, i: int, source: TensorSource) -> Layer:
        """Layer i over the tensors `source` holds (a streamed layer's buffer)."""
        p = layer_prefix(i) + "."
        shapes = {n: s for n, s in expected_shapes(self.spec).items() if n.startswith(p)}
        return self._load_layer(i, self.spec.layers[i], Weights(source, shapes), self._rotaries, {})

    def _load_layer(self, i: int, ls: LayerSpec, w: Weights, rotaries: dict, resident: dict) -> Layer:
        p, eps = layer_prefix(i), self.spec.rms_eps
        rotary = rotaries.setdefault(ls.attn.rope, Rotary(ls.attn.rope))  # layers share cos/sin tables
        if isinstance(ls.attn, MLASpec):
            attn = LatentAttention.load(ls.attn, w, f"{p}.self_attn", rotary, eps)
        else:
            attn = Attention.load(ls.attn, w, f"{p}.self_attn", rotary, eps)
        f = ls.ffn
        if isinstance(f, MLPSpec):
            ffn: MLP | MoE = MLP(f, ExpertWeights.load(w, f"{p}.{f.prefix}"))
        else:
            if not self.streamed:
                resident[i] = [ExpertWeights.load(w, expert_prefix(i, f, e), f.proj_names) for e in range(f.n_experts)]
            ffn = MoE(
                f, i, w[f"{p}.{f.prefix}.gate.weight"],
                w.get(f"{p}.{f.prefix}.gate.e_score_correction_bias"),
                ExpertWeights.load(w, f"{p}.{f.prefix}.{f.shared_prefix}") if f.shared_ffn else None,
                w.get(f"{p}.{f.prefix}.shared_expert_gate.weight"),
                f"{p}.{f.prefix}",
            )
        return Layer(w[f"{p}.input_layernorm.weight"], attn, w[f"{p}.post_attention_layernorm.weight"], ffn)

    def forward(
        self,
        tokens: Sequence[int] | np.ndarray,
        cache: KVCache,
        *,
        all_logits: bool = False,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
    ) -> np.ndarray:
        """Run tokens [T] after what `cache` holds; logits [T, V] (or [1, V] for the last token only).

        Appends each MoE layer's routing to `routing` when a list is given; calls `probe` with the
        input of every weight matrix (by tensor name) when given.
        """
        return self.forward_batch([(tokens, cache)], all_logits=all_logits, routing=routing, probe=probe)[0]

    def forward_batch(
        self,
        items: Sequence[tuple[Sequence[int] | np.ndarray, KVCache]],
        *,
        all_logits: bool = False,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
    ) -> list[np.ndarray]:
        """Run several sequences' next tokens in one pass: each item is (tokens [T_i], its cache).

        The projections and experts run once for all rows (each distinct expert of a layer read once),
        attention per sequence on its own cache; every row is computed as it would be alone. Returns
        each sequence's logits ([T_i, V], or [1, V] for its last token).
        """
        ids_list = [np.asarray(tokens, dtype=np.int64).reshape(-1) for tokens, _ in items]
        for ids in ids_list:
            if ids.size == 0:
                raise GenerationError("no tokens to run: the prompt is empty")
            if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
                bad = int(ids[(ids < 0) | (ids >= self.spec.vocab_size)][0])
                raise GenerationError(f"token id {bad} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        caches = [cache for _, cache in items]
        if len({id(c) for c in caches}) != len(caches):
            raise GenerationError("a sequence appears twice in one batch")
        if (len(items) > 1 and not self.streamed and routing is None and probe is None
                and all(i.size == 1 for i in ids_list)
                and all(self._fused_step(1, c, None) is not None for c in caches)):
            # one token of each of several sequences: one pass for all, or a fused step for each, whichever
            # measures faster per token (the same bits either way). Here the fused steps won up to 8
            # sequences: 96-104 tok/s against 57-81 on mixtral-1.7b, 159-167 against 84-150 on SmolLM2-135M.
            apart = self._apart.pick(1, 0)
            t0 = time.perf_counter()
            if apart:
                for i, c in zip(ids_list, caches):     # room for every token first (preparing again is a no-op):
                    c.prepare(i)                       # one that cannot go on fails the step before any has run
                out = [self._pass([i], [c], all_logits, None, None)[0] for i, c in zip(ids_list, caches)]
            else:
                out = self._pass(ids_list, caches, all_logits, None, None)
            self._apart.record(apart, (time.perf_counter() - t0) / len(items))
            return out
        return self._pass(ids_list, caches, all_logits, routing, probe)

    def _pass(self, ids_list: list[np.ndarray], caches: list[KVCache], all_logits: bool,
              routing: list[Routing] | None, probe: Probe | None) -> list[np.ndarray]:
        """forward_batch's pass over validated tokens: one fused step, or the blocks for every row at once."""
        pos_list = [cache.prepare(ids) for ids, cache in zip(ids_list, caches)]
        ids, positions = np.concatenate(ids_list), np.concatenate(pos_list)
        bounds = np.cumsum([0] + [i.size for i in ids_list])
        rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        eps, tel = self.spec.rms_eps, self.telemetry
        # experts read ahead for one token only. Several at once (a prompt, a batch): the union of their guesses is
        # most of a layer's experts, read while the current layer's union still holds the cache. Measured on
        # mixtral-1.7b at the dense part plus 10% / 25% of the experts: prompts ran at 59-75 / 64-83 tok/s reading
        # ahead, 82-106 / 91-109 without.
        ahead = self.prefetch_depth if self.reads_ahead and ids.size == 1 else 0
        with tel.phase("dense"):
            x = embed_rows(self.embed, ids)                                 # [T, hidden]
        fused = self._fused_step(ids.size, caches[0], probe)
        if fused is not None:
            if self.streamed:
                depth = self._ahead.pick(ahead, 0)
                t0 = time.perf_counter()
                for j in range(min(depth, len(self.layers))):
                    self._predict(j, x)
                n = len(self.layers)

                def predict(i: int, xi: np.ndarray) -> None:   # a call stopped at layer i: read ahead from there
                    if depth and i + depth < n:
                        self._predict(i + depth, xi[None])
                logits, step = fused.run(x[0], caches[0], int(positions[0]), self.experts, predict, depth,
                                         self.lookahead_extra)
                self._ahead.record(depth, time.perf_counter() - t0)
            else:
                logits, step = fused.run(x[0], caches[0], int(positions[0]))
            if step.attention is not None:               # as the blocks' attention hands them over, layer by layer
                for weights in step.attention:
                    caches[0].observe(weights)
            caches[0].commit(1)
            record(step, tel)
            if routing is not None:
                routing.extend(step.routing())
            if self.streamed:
                self.experts.end_token(1)
            tel.end_token(1, prefill=False)
            return [logits]
        for j in range(min(ahead, len(self.layers))):
            self._predict(j, x)
        for i, layer in enumerate(self.layers):
            if layer is None:
                layer = self.layer_source.layer(i)
            segments = [(r, cache.layers[i]) for r, cache in zip(rows, caches)]
            with tel.phase("attention"):
                x = x + layer.attn(rms_norm(x, layer.input_norm, eps), positions, segments, probe)
            h = rms_norm(x, layer.post_norm, eps)
            if isinstance(layer.ffn, MoE):
                y, r = layer.ffn(h, self.experts, probe, tel)
                tel.route(i, r.experts)
                if routing is not None:
                    routing.append(r)
            else:
                with tel.phase("dense"):
                    y = layer.ffn(h, probe)
            x = x + y
            if ahead and i + ahead < len(self.layers):
                self._predict(i + ahead, x)
        for ids_i, cache in zip(ids_list, caches):
            cache.commit(ids_i.size)
        if not all_logits:
            x = x[bounds[1:] - 1]
        x = rms_norm(x, self.norm, eps)
        if probe is not None:
            probe("lm_head.weight", x)
        with tel.phase("dense"):
            logits = linear(x, self.lm_head)                              # [T or batch, V]
        if self.streamed:
            self.experts.end_token(ids.size)
        tel.end_token(ids.size, prefill=ids.size > len(caches))
        if all_logits:
            return [logits[r] for r in rows]
        return [logits[k : k + 1] for k in range(len(caches))]

    def _fused_step(self, n_tokens: int, cache: KVCache, probe: Probe | None) -> "FusedDecode | None":
        """The fused decode step when this step is one token of one sequence that it can run, else None."""
        if n_tokens != 1 or probe is not None or not self.fused_decode:
            return None
        if self._fused is False:
            self._fused = FusedDecode.for_model(self)
        if self._fused is None or not self._fused.accepts(cache):
            return None
        return self._fused

    def _predict(self, j: int, x: np.ndarray) -> None:
        """Start reading the experts layer j's router would choose for the hidden state x [T, hidden]."""
        layer = self.layers[j]
        if layer is None or not isinstance(layer.ffn, MoE):
            return
        moe = layer.ffn
        h = rms_norm(x, layer.post_norm, self.spec.rms_eps)
        extra = moe.spec.top_k // 2 if self.lookahead_extra is None else self.lookahead_extra
        k = min(moe.spec.n_experts, moe.spec.top_k + extra)
        spec = self._guess_specs.get((j, k))
        if spec is None:
            spec = moe.spec if k == moe.spec.top_k else dataclasses.replace(moe.spec, top_k=k)
            self._guess_specs[(j, k)] = spec
        ids, _ = route(spec, h @ moe.router.T, moe.correction_bias)           # [T, k]
        self.experts.prefetch(j, ids[0].tolist() if ids.shape[0] == 1 else np.unique(ids).tolist())
