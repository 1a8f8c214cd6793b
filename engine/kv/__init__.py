"""The paged KV cache: a pool of fixed-size blocks shared by sequences, a prefix index, retention.

- `KVPool` holds, for every layer, keys and values (or, for multi-head latent attention, the
  compressed latent and the shared rotary key, plus the sparse-attention indexer's key where the
  layer has one) in blocks of `block_size` positions. Each layer's
  arrays are C-contiguous [n_blocks, ...] anonymous mappings, reserved up front but committed only
  as blocks are written; a block that is freed hands its pages back to the system.
- A full block is indexed by a hash of its tokens and of everything before it. A sequence that
  starts with the same tokens (a system prompt, earlier turns, the same document) takes those
  blocks instead of computing them again. Blocks are reference counted; unused indexed blocks stay
  cached and are evicted least recently used first when the pool needs room.
- `KVCache` is one sequence: its block table, its tokens, its length. Attention reads the blocks
  directly through the table (`engine.kernels.attention`).
- Past `max_len`, a sequence fails (`overflow="error"`, the default), or evicts whole blocks:
  the oldest (`"slide"`), or the block whose tokens drew the least attention so far while keeping
  the first tokens (attention sinks) and the recent window (`"retain"`). Either way the positions
  of the blocks after the evicted one move down (their rotary keys are rotated back), so positions
  stay inside the context the model knows. Both change outputs and are only on when asked.
- A recurrent layer (gated DeltaNet) has no blocks: its `LayerState` keeps the sequence's state (a
  convolution's last inputs and a recurrent matrix per head) after the held tokens, and after each
  token of a short step, so a sequence can go back into its last step (speculative drafts) but not
  further. Blocks alone cannot rebuild its state: the pool keeps snapshots of every recurrent layer's
  state at block boundaries (`engine.recurrent.Checkpoints`, charged blocks of the pool), and a sequence
  adopts a cached prefix only up to the longest boundary with a snapshot. Overflow past `max_len` is refused.
- `kv_bits=16` stores rows as fp16 (half the memory of float32, rounded to nearest); `kv_bits=8` as
  int8 with one float32 scale per row (per head for keys and values).
- A sliding-window layer needs only its window: once no sequence holding a block can attend to it any more
  in that layer (every holder's next query lies more than the window past it), the layer's rows of the block
  are dropped (their pages returned), while full-attention layers keep theirs. A sequence that truncates or
  adopts a prefix back to where a window's rows are gone holds less (the rest is computed again); retention
  evicts no block a window would reach again once the later blocks move down.

Modules: `pool` (blocks, the prefix index, `KVPool`), `layers` (each layer's view of a sequence: `LayerKV`,
`LayerState`, row encoding), `retention` (the block to evict, rotating keys back), `cache` (`KVCache`, one
sequence). Their public names are imported from here.
"""

from engine.kv.cache import KVCache
from engine.kv.layers import KEEP_STEP, LayerKV, LayerState
from engine.kv.pool import (
    BLOCK_SIZE,
    KV_BITS,
    OVERFLOW,
    ROOT,
    KVFullError,
    KVPool,
    block_bytes,
    blocks_for,
    check_kv_settings,
    prefix_digest,
)
from engine.kv.retention import SINK_TOKENS, choose_victim

__all__ = [
    "BLOCK_SIZE", "KEEP_STEP", "KV_BITS", "OVERFLOW", "ROOT", "SINK_TOKENS", "KVCache", "KVFullError", "KVPool",
    "LayerKV", "LayerState", "block_bytes", "blocks_for", "check_kv_settings", "choose_victim", "prefix_digest",
]
