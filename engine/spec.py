"""The model spec: every hyperparameter the engine needs, parsed from the checkpoint's own files.

A spec is immutable and holds no weights. Family modules in `engine.models` build it from a
`config.json` dict (GGUF metadata is first turned into such a dict); the shared blocks in
`engine.blocks` read it. Tensor names are Hugging Face's, whatever the file format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding over the first `dim` features of a head."""

    dim: int                      # rotated features per head (even)
    theta: float                  # base wavelength
    kind: str = "default"         # default | linear | llama3 | yarn | longrope | none (no rotation: Kimi Linear)
    factor: float = 1.0           # context extension factor (linear, llama3, yarn, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 0  # llama3, yarn, longrope
    beta_fast: float = 32.0       # yarn
    beta_slow: float = 1.0        # yarn
    mscale: float = 0.0           # yarn
    mscale_all_dim: float = 0.0   # yarn
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale; derived when None
    truncate: bool = True         # yarn
    interleaved: bool = False     # pairs (x0, x1), (x2, x3) rotate together (DeepSeek-V3)
    # per-frequency divisors: GGUF rope_freqs (e.g. Llama 3.1), or longrope's factors (the ones in use)
    freq_factors: tuple[float, ...] | None = None
    # Phi-3 LongRoPE: the factors above hold below this position only (the reference takes its long factors for a
    # whole sequence once it is longer); None when they hold at every position
    max_position: int | None = None

    def inv_freq(self) -> np.ndarray:
        """Inverse frequencies [dim/2] as float32, computed the way the reference does (all 0 for kind "none":
        cos 1 and sin 0 at every position, so the rotation leaves a head's bits as they are)."""
        if self.kind == "none":
            return np.zeros(self.dim // 2, np.float32)
        exponent = np.arange(0, self.dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.dim)
        base = np.float32(self.theta) ** exponent  # float32 like the reference
        inv = (np.float32(1.0) / base).astype(np.float32)
        if self.kind == "longrope":       # 1 / (factor * base^x), in the reference's order of operations
            return (np.float32(1.0) / (np.asarray(self.freq_factors, np.float32) * base)).astype(np.float32)
        if self.freq_factors is not None:  # llama.cpp stores the scaling as factors instead of a rope type
            return (inv / np.asarray(self.freq_factors, np.float32)).astype(np.float32)
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "llama3":
            return _llama3_inv_freq(inv, self)
        if self.kind == "yarn":
            return _yarn_inv_freq(base, self)
        return inv

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
        if self.kind == "longrope":
            return float(self.attention_factor) if self.attention_factor is not None else \
                _longrope_attention(self.factor, self.original_max_position)
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_attention(factor: float, original: int) -> float:
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv: np.ndarray, r: RopeSpec) -> np.ndarray:
    low_wavelen = r.original_max_position / r.low_freq_factor
    high_wavelen = r.original_max_position / r.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(r.factor), inv).astype(np.float32)
    smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(r.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(pos_freqs: np.ndarray, r: RopeSpec) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return (r.dim * math.log(r.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r.dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = np.clip((np.arange(r.dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(r.factor) * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention (multi-head when n_kv_heads == n_heads)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: RopeSpec
    scale: float                      # softmax scale, usually head_dim ** -0.5
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None        # None | "head" (per head, Qwen3) | "full" (whole projection, OLMoE)
    clip_qkv: float | None = None     # OLMoE: clamp q, k, v to [-c, c]
    sliding_window: int | None = None  # attend to the last `sliding_window` positions only
    sinks: bool = False               # gpt-oss: a learned logit per head joins each softmax's denominator
    output_gate: bool = False         # q_proj also yields, per head, a gate: out * sigmoid(gate) (Qwen3-Next)
    softcap: float | None = None      # Gemma 2: scores -> tanh(scores / c) * c before the mask


@dataclass(frozen=True)
class IndexerSpec:
    """DeepSeek sparse attention's indexer (GLM-5): each query attends only to the `topk` keys it scores best.

    Its own small query (from the q LoRA latent) and single shared key (cached per token), both with RoPE
    on their first `rope_dim` features; a key's score is sum over heads of w_h * relu(q_h . k) * D^-0.5.
    A `shared` layer has no indexer of its own: it reuses the selection of the nearest full layer before it.
    """

    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    rope_interleaved: bool = True     # GLM-5 rotates pairs (x0, x1), ...; DeepSeek-V3.2 halves
    norm_eps: float = 1e-6            # the key's LayerNorm
    shared: bool = False
    source: int | None = None         # shared: the layer whose selection it reuses


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a compressed latent."""

    n_heads: int
    q_lora_rank: int | None           # None: q comes straight from q_proj
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    rope: RopeSpec
    scale: float
    bias: bool = False                # attention_bias on q_a_proj / kv_a_proj / o_proj
    norm_eps: float | None = None     # q_a / kv_a RMSNorm epsilon; None: the model's rms_eps
    indexer: IndexerSpec | None = None  # sparse attention (GLM-5): attend only to the keys it selects

    @property
    def qk_head_dim(self) -> int:
        """Query/key features per head."""
        return self.qk_nope_dim + self.qk_rope_dim


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet linear attention (Qwen3-Next): a short causal convolution, then a per-head recurrent
    state [Dk, Dv] updated by the gated delta rule. It keeps that state per sequence instead of a KV cache."""

    n_k_heads: int                    # query/key heads
    n_v_heads: int                    # value heads (a multiple of n_k_heads; each k head serves a group)
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int                  # taps of the depthwise causal convolution over q, k, v
    act: str = "silu"                 # the convolution's activation
    rms_eps: float = 1e-6             # the gated output norm's epsilon
    split_proj: bool = False          # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a apart, heads in order

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v side by side."""
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one sequence's state: the convolution's last inputs, the recurrent matrices."""
        return (self.conv_kernel - 1, self.conv_dim), (self.n_v_heads, self.k_head_dim, self.v_head_dim)


@dataclass(frozen=True)
class KimiDeltaSpec(GatedDeltaNetSpec):
    """Kimi delta attention (Kimi Linear): the gated delta rule with a decay per key channel rather than per
    head, q, k and v projected and convolved apart, a low-rank forget gate and a low-rank sigmoid output gate.
    Key and value heads are the same heads (n_k_heads == n_v_heads, k_head_dim == v_head_dim); its state has
    DeltaNet's shapes and lives in the same `LayerState`."""


@dataclass(frozen=True)
class MLPSpec:
    """A gated feed-forward network: down(act(gate(x)) * up(x))."""

    intermediate: int
    act: str = "silu"
    prefix: str = "mlp"               # tensor name prefix inside the layer
    bias: bool = False                # gate, up and down carry biases (ERNIE 4.5's use_bias)


@dataclass(frozen=True)
class MoESpec:
    """A routed Mixture-of-Experts block, with optional shared experts."""

    n_experts: int
    top_k: int
    expert_ffn: int                   # intermediate size of one routed expert
    scoring: str = "softmax"          # softmax | sigmoid | sparsemixer (PhiMoE: two experts, see blocks.ffn)
    norm_topk_prob: bool = True       # renormalise the chosen experts' weights to sum to 1
    n_group: int = 1                  # group-limited routing (DeepSeek-V3)
    topk_group: int = 1
    group_score: str = "top2"         # a group's rank: "top2" sum of its two best (V3) | "max" its best (V2)
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False     # e_score_correction_bias added for choice only
    bias_name: str = "gate.e_score_correction_bias"   # that bias's tensor, under `prefix`
    bias_shape: tuple[int, ...] = ()  # its shape when not [n_experts] (ERNIE 4.5: [1, n_experts])
    norm_min: float = 0.0             # renormalisation divides by max(sum, norm_min) (ERNIE 4.5's moe_norm_min)
    jitter_eps: float = 0.0           # sparsemixer: experts within 2 * jitter_eps of the best share its softmax
    shared_ffn: int = 0               # intermediate size of the shared expert(s); 0 = none
    shared_gate: bool = False         # sigmoid(shared_expert_gate(x)) scales the shared output
    shared_bias: bool = False         # the shared expert's projections carry biases (ERNIE 4.5's use_bias)
    act: str = "silu"
    prefix: str = "mlp"               # "mlp" or "block_sparse_moe"
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    shared_prefix: str = "shared_expert"  # or "shared_experts" (DeepSeek)
    router_bias: bool = False         # gpt-oss: gate.bias [E] added to the router logits
    expert_bias: bool = False         # gpt-oss: every expert's gate, up and down carry a bias
    swiglu_limit: float | None = None  # gpt-oss: (clamp(up, +-l) + 1) * g * sigmoid(alpha g), g = min(gate, l)
    swiglu_alpha: float = 1.0         # with swiglu_limit


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: attention then feed-forward, each with its residual, normed as `norms` says.

    "pre": RMSNorm before each block (Llama). "sandwich": before and after each block (Gemma 2/3).
    "post": after each block only, before the residual add (OLMo 2).
    """

    attn: AttentionSpec | MLASpec | GatedDeltaNetSpec
    ffn: MLPSpec | MoESpec
    norms: str = "pre"                # pre | sandwich | post


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model: embedding, layers, final norm, output head."""

    architecture: str                 # the checkpoint's own name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_eps: float
    tie_embeddings: bool
    max_position: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0  # Granite: the embeddings are scaled by it
    residual_multiplier: float = 1.0   # Granite: each block's output is scaled by it before the residual add
    logits_scaling: float = 1.0        # Granite: the logits are divided by it
    norm_offset: float = 0.0          # added to the layer, q/k and final RMSNorm weights: 1 for (1 + w) norms
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to float32 as the reference does
    final_softcap: float | None = None  # Gemma 2: logits -> tanh(logits / c) * c
    norm: str = "rms"                 # rms (RMSNorm) | layer (LayerNorm with a bias: PhiMoE), for every norm
    lm_head_bias: bool = False        # the output head adds lm_head.bias
    extra: dict = field(default_factory=dict, compare=False)  # source notes (format, file names)

    @property
    def n_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes to experts."""
        return any(isinstance(layer.ffn, MoESpec) for layer in self.layers)

    @property
    def is_recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state per sequence (that a prefix of KV blocks cannot rebuild)."""
        return any(isinstance(layer.attn, GatedDeltaNetSpec) for layer in self.layers)
