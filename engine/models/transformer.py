"""The decoder-only transformer every family shares: embed, N x (attention + feed-forward), norm, head.

A family module only turns its config into a `ModelSpec`; this module knows tensor names
(Hugging Face's), checks them against the spec, and runs the forward pass on a `KVCache`. What a run
decides as it goes (the fused step, the online choosers, read-ahead settings, telemetry) lives in the
model's `DecodeContext` (engine/models/context.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from engine.blocks.attention import Attention, attention_shapes
from engine.blocks.deltanet import GatedDeltaNet, deltanet_shapes
from engine.blocks.ffn import (
    MLP,
    ExpertBiases,
    ExpertSource,
    ExpertWeights,
    MoE,
    ResidentExperts,
    Routing,
    StreamingExpertSource,
    expert_bias_shapes,
    mlp_shapes,
)
from engine.blocks.kda import KimiDeltaAttention, kda_shapes
from engine.blocks.linear import Probe, linear
from engine.blocks.mla import LatentAttention, mla_shapes
from engine.blocks.norm import normalize, rms_norm
from engine.blocks.rope import Rotary
from engine.errors import GenerationError
from engine.kv import KVCache
from engine.models.context import DecodeContext
from engine.spec import GatedDeltaNetSpec, KimiDeltaSpec, LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec
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


# Each norm layout's tensors, in the order of Layer's fields input_norm, post_norm, attn_out_norm, ffn_out_norm
# (None: the layout has no such norm). post_attention_layernorm is the feed-forward's input norm in Llama's
# layout and the attention output's norm in Gemma's and OLMo 2's.
NORM_FIELDS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", "post_attention_layernorm", None, None),
    "sandwich": ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, None, "post_attention_layernorm", "post_feedforward_layernorm"),
}
NORM_NAMES = {layout: tuple(n for n in names if n) for layout, names in NORM_FIELDS.items()}


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
    if spec.lm_head_bias:
        shapes["lm_head.bias"] = (spec.vocab_size,)
    norm_bias = spec.norm == "layer"
    if norm_bias:
        shapes["model.norm.bias"] = (h,)
    for i, layer in enumerate(spec.layers):
        p = layer_prefix(i)
        for name in NORM_NAMES[layer.norms]:
            shapes[f"{p}.{name}.weight"] = (h,)
        if norm_bias:
            shapes[f"{p}.input_layernorm.bias"] = (h,)
            shapes[f"{p}.post_attention_layernorm.bias"] = (h,)
        if isinstance(layer.attn, KimiDeltaSpec):        # before DeltaNet: a kind of it, under self_attn
            shapes |= kda_shapes(layer.attn, f"{p}.self_attn", h)
        elif isinstance(layer.attn, GatedDeltaNetSpec):
            shapes |= deltanet_shapes(layer.attn, f"{p}.linear_attn", h)
        elif isinstance(layer.attn, MLASpec):
            shapes |= mla_shapes(layer.attn, f"{p}.self_attn", h)
        else:
            shapes |= attention_shapes(layer.attn, f"{p}.self_attn", h)
        ffn = layer.ffn
        if isinstance(ffn, MLPSpec):
            shapes |= mlp_shapes(f"{p}.{ffn.prefix}", h, ffn.intermediate, bias=ffn.bias)
            continue
        shapes[f"{p}.{ffn.prefix}.gate.weight"] = (ffn.n_experts, h)
        if ffn.correction_bias:
            shapes[f"{p}.{ffn.prefix}.{ffn.bias_name}"] = ffn.bias_shape or (ffn.n_experts,)
        if ffn.router_bias:
            shapes[f"{p}.{ffn.prefix}.gate.bias"] = (ffn.n_experts,)
        for e in range(ffn.n_experts):
            shapes |= mlp_shapes(expert_prefix(i, ffn, e), h, ffn.expert_ffn, ffn.proj_names)
            if ffn.expert_bias:
                shapes |= expert_bias_shapes(expert_prefix(i, ffn, e), h, ffn.expert_ffn, ffn.proj_names)
        if ffn.shared_ffn:
            shapes |= mlp_shapes(f"{p}.{ffn.prefix}.{ffn.shared_prefix}", h, ffn.shared_ffn, bias=ffn.shared_bias)
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
    """One decoder layer's blocks and its RMSNorm weights (None where its layout has no such norm)."""

    input_norm: np.ndarray | None  # [hidden], the attention's input
    attn: Attention | LatentAttention | GatedDeltaNet | KimiDeltaAttention
    post_norm: np.ndarray | None   # [hidden], the feed-forward's input
    ffn: MLP | MoE
    attn_out_norm: np.ndarray | None = None  # [hidden], the attention's output (Gemma, OLMo 2)
    ffn_out_norm: np.ndarray | None = None   # [hidden], the feed-forward's output (Gemma, OLMo 2)
    input_norm_bias: np.ndarray | None = None   # [hidden]: LayerNorm models only (ModelSpec.norm == "layer")
    post_norm_bias: np.ndarray | None = None    # [hidden]

    @property
    def plain(self) -> bool:
        """Whether the layer is pre-norm only (Llama's layout, the one the fused step runs)."""
        return self.input_norm is not None and self.post_norm is not None and self.attn_out_norm is None \
            and self.ffn_out_norm is None

    @property
    def norm_bytes(self) -> int:
        """Bytes of the layer's norm weights."""
        return sum(int(n.nbytes) for n in (self.input_norm, self.post_norm, self.attn_out_norm, self.ffn_out_norm)
                   if n is not None)

    def attn_input(self, x: np.ndarray, eps: float) -> np.ndarray:
        """The attention's input [T, hidden] from the residual stream x (LayerNorm where the norm has a bias)."""
        if self.input_norm is None:
            return x
        return normalize(x, self.input_norm, self.input_norm_bias, eps, "rms" if self.input_norm_bias is None else "layer")

    def ffn_input(self, x: np.ndarray, eps: float) -> np.ndarray:
        """The feed-forward's input [T, hidden] from the residual stream x (LayerNorm where the norm has a bias)."""
        if self.post_norm is None:
            return x
        return normalize(x, self.post_norm, self.post_norm_bias, eps, "rms" if self.post_norm_bias is None else "layer")

    def attn_output(self, y: np.ndarray, eps: float) -> np.ndarray:
        """What the attention adds to the residual stream, from its output y [T, hidden]."""
        return y if self.attn_out_norm is None else rms_norm(y, self.attn_out_norm, eps)

    def ffn_output(self, y: np.ndarray, eps: float) -> np.ndarray:
        """What the feed-forward adds to the residual stream, from its output y [T, hidden]."""
        return y if self.ffn_out_norm is None else rms_norm(y, self.ffn_out_norm, eps)


class Transformer:
    """A decoder-only model ready to run: read-only weights plus the forward pass.

    Routed experts come from `experts` when given (a streaming store: the checkpoint's experts are then
    never touched here), else they are held resident. With a store that reads ahead (`prefetch_depth`),
    the router of layer i + D applied to the hidden state after layer i predicts that layer's experts.
    `forward` and `forward_batch` run through the model's `context`, made here once with `telemetry` and
    `prefetch_depth`.
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
        self.streamed = experts is not None
        self.reads_ahead = isinstance(experts, StreamingExpertSource)   # declared once: the check is not free
        self.layer_source = layers
        w = Weights(source, expected_shapes(spec))
        self.embed = w["model.embed_tokens.weight"]                          # [V, hidden]
        self.norm = self._norm_weight(w["model.norm.weight"])
        self._embed_scale = None if spec.embed_scale is None else np.float32(spec.embed_scale)
        self.norm_bias = w.get("model.norm.bias")                           # [hidden] or None
        self.lm_head = self.embed if spec.tie_embeddings else w["lm_head.weight"]  # [V, hidden]
        self.lm_head_bias = w.get("lm_head.bias")                           # [V] or None
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
        self.context = DecodeContext(self, telemetry, prefetch_depth)

    def _build_layer(self, i: int, source: TensorSource) -> Layer:
        """Layer i over the tensors `source` holds (a streamed layer's buffer)."""
        p = layer_prefix(i) + "."
        shapes = {n: s for n, s in expected_shapes(self.spec).items() if n.startswith(p)}
        return self._load_layer(i, self.spec.layers[i], Weights(source, shapes), self._rotaries, {})

    def _norm_weight(self, weight: np.ndarray) -> np.ndarray:
        """An RMSNorm weight as the norm multiplies by it: (1 + w) for zero-centred norms (`norm_offset`)."""
        if not self.spec.norm_offset:
            return weight
        return (np.float32(self.spec.norm_offset) + weight).astype(np.float32)

    def _load_layer(self, i: int, ls: LayerSpec, w: Weights, rotaries: dict, resident: dict) -> Layer:
        p, eps = layer_prefix(i), self.spec.rms_eps
        attn: Attention | LatentAttention | GatedDeltaNet | KimiDeltaAttention
        if isinstance(ls.attn, KimiDeltaSpec):
            attn = KimiDeltaAttention.load(ls.attn, w, f"{p}.self_attn")
        elif isinstance(ls.attn, GatedDeltaNetSpec):
            attn = GatedDeltaNet.load(ls.attn, w, f"{p}.linear_attn")
        else:
            rotary = rotaries.setdefault(ls.attn.rope, Rotary(ls.attn.rope))  # layers share cos/sin tables
            if isinstance(ls.attn, MLASpec):
                attn = LatentAttention.load(ls.attn, w, f"{p}.self_attn", rotary, eps)
            else:
                attn = Attention.load(ls.attn, w, f"{p}.self_attn", rotary, eps)
                if self.spec.norm_offset and attn.q_norm is not None:
                    attn = dataclasses.replace(attn, q_norm=self._norm_weight(attn.q_norm),
                                               k_norm=self._norm_weight(attn.k_norm))
        f = ls.ffn
        if isinstance(f, MLPSpec):
            ffn: MLP | MoE = MLP(f, ExpertWeights.load(w, f"{p}.{f.prefix}", bias=f.bias))
        else:
            if not self.streamed:
                resident[i] = [ExpertWeights.load(w, expert_prefix(i, f, e), f.proj_names) for e in range(f.n_experts)]
            bias = w.get(f"{p}.{f.prefix}.{f.bias_name}")
            ffn = MoE(
                f, i, w.dense(f"{p}.{f.prefix}.gate.weight"),                         # an FP8 router widened
                bias.reshape(-1) if bias is not None else None,                     # [E]
                ExpertWeights.load(w, f"{p}.{f.prefix}.{f.shared_prefix}", bias=f.shared_bias) if f.shared_ffn else None,
                w.get(f"{p}.{f.prefix}.shared_expert_gate.weight"),
                f"{p}.{f.prefix}",
                w.get(f"{p}.{f.prefix}.gate.bias"),
                ExpertBiases.load(w, [expert_prefix(i, f, e) for e in range(f.n_experts)], f.proj_names)
                if f.expert_bias else None,
            )
        norms = [None if name is None else self._norm_weight(w[f"{p}.{name}.weight"]) for name in NORM_FIELDS[ls.norms]]
        return Layer(norms[0], attn, norms[1], ffn, norms[2], norms[3],
                     w.get(f"{p}.input_layernorm.bias"), w.get(f"{p}.post_attention_layernorm.bias"))

    def forward(
        self,
        tokens: Sequence[int] | np.ndarray,
        cache: KVCache,
        *,
        all_logits: bool = False,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
        hidden: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """Run tokens [T] after what `cache` holds; logits [T, V] (or [1, V] for the last token only).

        Appends each MoE layer's routing to `routing` when a list is given; calls `probe` with the
        input of every weight matrix (by tensor name) when given; appends the last layer's output
        [T, hidden] (every row, before the final norm) to `hidden` when given.
        """
        return self.forward_batch([(tokens, cache)], all_logits=all_logits, routing=routing, probe=probe,
                                  hidden=hidden)[0]

    def forward_batch(
        self,
        items: Sequence[tuple[Sequence[int] | np.ndarray, KVCache]],
        *,
        all_logits: bool = False,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
        hidden: list[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Run several sequences' next tokens in one pass: each item is (tokens [T_i], its cache).

        The projections and experts run once for all rows (each distinct expert of a layer read once),
        attention per sequence on its own cache; every row is computed as it would be alone. Returns
        each sequence's logits ([T_i, V], or [1, V] for its last token). `hidden`, when given, receives
        the last layer's output of all rows [sum T_i, hidden] before the final norm (no fused step then).
        """
        return self.context.forward_batch(items, all_logits=all_logits, routing=routing, probe=probe, hidden=hidden)

    def token_ids(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The token ids [T] of one sequence as int64, checked against the vocabulary."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GenerationError("no tokens to run: the prompt is empty")
        if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.spec.vocab_size)][0])
            raise GenerationError(f"token id {bad} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        return ids

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The embeddings [T, hidden] of token ids [T] (times the spec's embedding multiplier, Granite, or its
        embed_scale, Gemma's sqrt(hidden))."""
        x = embed_rows(self.embed, ids)
        m = self.spec.embedding_multiplier
        if m != 1.0:
            x = x * np.float32(m)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        return x

    def run_layers(
        self,
        x: np.ndarray,
        positions: np.ndarray,
        rows: list[slice],
        caches: list[KVCache],
        *,
        routing: list[Routing] | None = None,
        probe: Probe | None = None,
        telemetry: Telemetry = NULL,
        after_layer: Callable[[int, np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """The hidden states [T, hidden] after every decoder layer, from x [T, hidden] at `positions` [T].

        Rows `rows[s]` are sequence s's, attending on `caches[s]` (prepared, not yet committed); each MoE
        layer's routing goes to `routing`, each matrix's input to `probe`; `after_layer(i, x)` is called
        with each layer's output.
        """
        eps, tel = self.spec.rms_eps, telemetry
        residual = np.float32(self.spec.residual_multiplier)     # Granite scales each block's output
        scaled = self.spec.residual_multiplier != 1.0
        for i, layer in enumerate(self.layers):
            if layer is None:
                layer = self.layer_source.layer(i)
            segments = [(r, cache.layers[i]) for r, cache in zip(rows, caches)]
            with tel.phase("attention"):
                a = layer.attn_output(layer.attn(layer.attn_input(x, eps), positions, segments, probe), eps)
                x = x + (a * residual if scaled else a)
            h = layer.ffn_input(x, eps)                                     # [T, hidden]
            if isinstance(layer.ffn, MoE):
                y, r = layer.ffn(h, self.experts, probe, tel)
                tel.route(i, r.experts)
                if routing is not None:
                    routing.append(r)
            else:
                with tel.phase("dense"):
                    y = layer.ffn(h, probe)
            y = layer.ffn_output(y, eps)
            x = x + (y * residual if scaled else y)
            if after_layer is not None:
                after_layer(i, x)
        return x

    def head(self, x: np.ndarray, probe: Probe | None = None, telemetry: Telemetry = NULL) -> np.ndarray:
        """The logits [T, V] of the final hidden states x [T, hidden] (plus the head's bias, if any, divided by
        the spec's logits scaling, or soft-capped when the spec says so)."""
        x = normalize(x, self.norm, self.norm_bias, self.spec.rms_eps, self.spec.norm)
        if probe is not None:
            probe("lm_head.weight", x)
        with telemetry.phase("dense"):
            logits = linear(x, self.lm_head)                                # [T, V]
            if self.lm_head_bias is not None:
                logits = logits + self.lm_head_bias
        d = self.spec.logits_scaling
        if d != 1.0:
            logits = logits / np.float32(d)
        cap = self.spec.final_softcap
        if cap is not None:                                                 # Gemma 2: tanh(logits / c) * c
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits
