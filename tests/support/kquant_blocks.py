"""A plain numpy quantizer to GGUF K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4 blocks (IQ4_NL, IQ4_XS),
which the `gguf` package cannot make.

The scales are chosen simply (min/max per sub-block, not llama.cpp's search): tests need valid blocks
laid out exactly as ggml lays them out, whose meaning `gguf.quants.dequantize` then defines.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SUPER = 256
TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
IQ_TYPES = (Q.IQ4_NL, Q.IQ4_XS)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
BYTES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.IQ4_NL: 18, Q.IQ4_XS: 136}
WEIGHTS = {Q.IQ4_NL: 32}                   # weights per block (256 for the others)


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [..., 2], their float32 values)."""
    h = v.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [n, 8] -> ggml's 12 bytes [n, 12] (bytes 0-3: sc[0..3] | top bits of sc[4..7],
    4-7: m[0..3] | top bits of m[4..7], 8-11: low nibbles of sc[4..7] and m[4..7])."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _k45(x: np.ndarray, bits: int) -> np.ndarray:
    """Super-blocks x [n, 256] -> Q4_K (bits 4) or Q5_K (bits 5) blocks [n, 144 or 176]."""
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)                                    # [n, 8]
    scale = (sub.max(axis=-1) - lo) / top
    d_bytes, d = _f16(scale.max(axis=-1) / 63)
    m_bytes, dmin = _f16(-lo.min(axis=-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d[:, None])).clip(0, 63).astype(np.uint8)
        m = np.nan_to_num(np.round(-lo / dmin[:, None])).clip(0, 63).astype(np.uint8)
        a = d[:, None] * sc.astype(np.float32)                              # what the dequantization uses
        b = dmin[:, None] * m.astype(np.float32)
        q = np.nan_to_num(np.round((sub + b[..., None]) / a[..., None])).clip(0, top).astype(np.uint8)   # [n, 8, 32]
    chunks = q.reshape(n, 4, 2, 32)
    qs = (chunks[:, :, 0] & 15) | ((chunks[:, :, 1] & 15) << 4)             # [n, 4, 32]
    parts = [d_bytes.reshape(n, 2), m_bytes.reshape(n, 2), _pack_scales(sc, m)]
    if bits == 5:
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)   # [n, 32]
        parts.append(qh)
    parts.append(qs.reshape(n, 128))
    return np.concatenate(parts, axis=1)


def _q6k(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] -> Q6_K blocks [n, 210]."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31                                   # [n, 16]
    d_bytes, d = _f16(scale.max(axis=-1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d[:, None])).clip(-128, 127).astype(np.int8)
        a = d[:, None] * sc.astype(np.float32)
        q = (np.nan_to_num(np.round(sub / a[..., None])).clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1)        # [n, 2, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes.reshape(n, 2)], axis=1)


def _q2k(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] -> Q2_K blocks [n, 84]: scales, qs, d, dmin."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    lo = np.minimum(sub.min(axis=-1), 0)                                    # [n, 16]
    scale = (sub.max(axis=-1) - lo) / 3
    d_bytes, d = _f16(scale.max(axis=-1) / 15)
    m_bytes, dmin = _f16(-lo.min(axis=-1) / 15)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d[:, None])).clip(0, 15).astype(np.uint8)
        m = np.nan_to_num(np.round(-lo / dmin[:, None])).clip(0, 15).astype(np.uint8)
        a = d[:, None] * sc.astype(np.float32)
        b = dmin[:, None] * m.astype(np.float32)
        q = np.nan_to_num(np.round((sub + b[..., None]) / a[..., None])).clip(0, 3).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)                                              # [n, half, crumb, byte]
    qs = (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)   # [n, 2, 32]
    return np.concatenate([sc | (m << 4), qs.reshape(n, 64), d_bytes.reshape(n, 2), m_bytes.reshape(n, 2)], axis=1)


def _q3k(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] -> Q3_K blocks [n, 110]: hmask, qs, scales, d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 4                                    # [n, 16]
    d_bytes, d = _f16(scale.max(axis=-1) / 31)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d[:, None])).clip(-32, 31).astype(np.int32)
        a = d[:, None] * sc.astype(np.float32)
        u = (np.nan_to_num(np.round(sub / a[..., None])).clip(-4, 3) + 4).astype(np.uint8).reshape(n, 256)
    hmask = ((u.reshape(n, 8, 32) >> 2) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    crumbs = (u & 3).reshape(n, 2, 4, 32)
    qs = (crumbs << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)   # [n, 2, 32]
    sc6 = (sc + 32).astype(np.uint8)                                        # [n, 16]
    scales = np.empty((n, 12), np.uint8)
    scales[:, :8] = (sc6[:, :8] & 15) | ((sc6[:, 8:] & 15) << 4)
    top = (sc6 >> 4) & 3
    scales[:, 8:] = top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:16] << 6)
    return np.concatenate([hmask, qs.reshape(n, 64), scales, d_bytes.reshape(n, 2)], axis=1)


def _nearest(v: np.ndarray) -> np.ndarray:
    """Codes of the KVALUES nearest to v (any shape) as uint8."""
    return np.abs(v[..., None] - KVALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_codes(q: np.ndarray) -> np.ndarray:
    """Codes [n, 32] of 32-weight (sub-)blocks -> their 16 bytes [n, 16] (low nibble weight j, high 16 + j)."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _iq4nl(x: np.ndarray) -> np.ndarray:
    """Blocks x [n, 32] -> IQ4_NL blocks [n, 18]: d, qs."""
    d_bytes, d = _f16(np.abs(x).max(axis=-1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = _nearest(np.nan_to_num(x / d[:, None]))
    return np.concatenate([d_bytes.reshape(-1, 2), _iq4_codes(q)], axis=1)


def _iq4xs(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] -> IQ4_XS blocks [n, 136]: d, scales_h, scales_l, qs."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    scale = np.abs(sub).max(axis=-1) / 127                                  # [n, 8]
    d_bytes, d = _f16(scale.max(axis=-1) / 31)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = (np.nan_to_num(np.round(scale / d[:, None])).clip(-32, 31) + 32).astype(np.uint16)   # [n, 8]
        dl = d[:, None] * (ls.astype(np.float32) - 32)
        q = _nearest(np.nan_to_num(sub / dl[..., None]))                    # [n, 8, 32]
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)    # [n]
    low = (ls & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)                           # [n, 4]
    return np.concatenate([d_bytes.reshape(n, 2), high.astype("<u2")[:, None].view(np.uint8), scales_l,
                           _iq4_codes(q.reshape(n * 8, 32)).reshape(n, 128)], axis=1)


def quantize_k(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """w [..., in] (in % 256 == 0; IQ4_NL: % 32) -> the K-quant or IQ4 bytes [..., in / block weights * block bytes]
    uint8, as a GGUF stores them."""
    if qtype not in TYPES + IQ_TYPES:
        raise ValueError(f"quantize_k makes {', '.join(t.name for t in TYPES + IQ_TYPES)}, not {qtype.name}")
    x = np.asarray(w, np.float32)
    block = WEIGHTS.get(qtype, SUPER)
    if x.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} weights, got {x.shape[-1]}")
    flat = x.reshape(-1, block)
    if qtype == Q.IQ4_NL:
        blocks = _iq4nl(flat)
    elif qtype == Q.IQ4_XS:
        blocks = _iq4xs(flat)
    elif qtype == Q.Q2_K:
        blocks = _q2k(flat)
    elif qtype == Q.Q3_K:
        blocks = _q3k(flat)
    else:
        blocks = _q6k(flat) if qtype == Q.Q6_K else _k45(flat, 4 if qtype == Q.Q4_K else 5)
    return blocks.reshape(*x.shape[:-1], -1)


def random_k_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes [rows, cols / block weights * block bytes] as K-quant or IQ4 blocks, with finite fp16 scales of
    either sign."""
    size, nb = BYTES[qtype], cols // WEIGHTS.get(qtype, SUPER)
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    d = (rng.standard_normal((rows, nb, 2)) * 0.01).astype(np.float16).view(np.uint8)   # [.., 2 values x 2 bytes]
    if qtype in IQ_TYPES:
        raw[..., 0:2] = d[..., 0:2]
    elif qtype == Q.Q6_K:
        raw[..., 208:210] = d[..., 0:2]
    elif qtype == Q.Q2_K:
        raw[..., 80:84] = d
    elif qtype == Q.Q3_K:
        raw[..., 108:110] = d[..., 0:2]
    else:
        raw[..., 0:4] = d
    return raw.reshape(rows, -1)
