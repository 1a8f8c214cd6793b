"""The messages of the engine service (app.service.local): requests and options going in, events and the
loaded model's description coming out. All frozen: they cross threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.events import Event
from engine.generation.grammar import Grammar
from engine.generation.sampling import SamplingParams
from engine.tokenizer.reasoning import ReasoningFormat

# Expert tiers as `EngineService.subscribe_tiers` reports them: an int8 grid [layers, experts] of these codes
TIER_NONE, TIER_DISK, TIER_CACHED, TIER_PINNED, TIER_RESIDENT = -1, 0, 1, 2, 3


# ---- what front ends send ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadOptions:
    """How to open a model: held whole, or streamed under a memory budget (the CLI's memory flags)."""

    max_memory: int | None = None       # bytes for the whole model; None: all that it needs (capped by free RAM)
    offload: bool | None = None         # weights on disk under the budget; None: for a Mixture-of-Experts container
    context_length: int | None = None   # None: DEFAULT_CONTEXT or the model's limit, whichever is less
    prefetch_depth: int = 1
    io: str = "pread"
    io_threads: int = 2
    cache_policy: str = "learned"
    resident_layers: int | None = None  # dense containers: layers held (None: as many as the budget allows)
    history: bool = True                # read and update the usage history that teaches the pins
    max_batch: int = 4                  # generations decoded together (more wait their turn)
    kv_bits: int = 32                   # 32: exact keys and values; 16: fp16 rows, half the memory; 8: int8, a quarter
    kv_block_size: int | None = None    # tokens per KV block (None: engine.kv.BLOCK_SIZE)
    overflow: str = "error"             # past the context: "error", "slide" or "retain" (see engine.kv)
    speculative: bool | str = False     # answers draft and verify: True by prompt lookup, "mtp" by the MTP head
    draft: int | None = None            # tokens drafted per step (None: 4, or 1 with mtp)
    threads: int | None = None          # compute threads of the engine thread (None: the process's, --threads)


@dataclass(frozen=True)
class SettingsChange:
    """Live settings to apply between tokens; None leaves a setting as it is."""

    memory_budget: int | None = None    # bytes, as --max-memory
    prefetch_depth: int | None = None
    io_threads: int | None = None
    context_length: int | None = None   # takes effect with the next generation's KV cache

    def merged(self, newer: SettingsChange) -> SettingsChange:
        """This change overridden by the non-None values of `newer`."""
        return SettingsChange(*(getattr(newer, f) if getattr(newer, f) is not None else getattr(self, f)
                                for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation, as the chat template reads it."""

    role: str       # "system" | "user" | "assistant"
    content: str
    reasoning: str = ""     # an assistant turn's reasoning, handed to the template as `reasoning_content`


def chat_message(message: ChatMessage | Mapping[str, Any]) -> ChatMessage:
    """A conversation turn as the service carries it (a dict's `reasoning_content` becomes `reasoning`)."""
    if isinstance(message, ChatMessage):
        return message
    return ChatMessage(str(message["role"]), str(message["content"]), str(message.get("reasoning_content") or ""))


@dataclass(frozen=True)
class LoadRequest:
    """Open a model (the current one is closed first)."""

    id: int
    path: str
    options: LoadOptions


@dataclass(frozen=True)
class GenerateRequest:
    """Generate from token ids or from chat messages rendered by the model's chat template."""

    id: int
    prompt: tuple[int, ...] | None              # token ids, or None to render `messages`
    messages: tuple[ChatMessage, ...] | None
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    reasoning: ReasoningFormat | None = None    # split the answer of token ids so; messages find their own
    logprobs: int | None = None                 # each token's log-probability and this many alternatives
    grammar: Grammar | None = None              # the answer must match it (structured output)
    speculative: bool | str | None = None       # draft (True, "lookup" or "mtp") or not (False); None: as loaded


@dataclass(frozen=True)
class UnloadRequest:
    """Close the loaded model."""

    id: int


@dataclass(frozen=True)
class AtlasRequest:
    """Compute the loaded model's atlas and save it beside the model."""

    id: int


@dataclass(frozen=True)
class _ApplySettings:
    """Wakes the idle engine thread to apply the pending settings."""


@dataclass(frozen=True)
class _Shutdown:
    """Ends the engine thread's loop."""


Request = LoadRequest | GenerateRequest | UnloadRequest | AtlasRequest | _ApplySettings | _Shutdown


# ---- what comes back -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSettings:
    """The live settings in force."""

    memory_budget: int | None   # bytes for the whole model; None: held whole (no budget applies)
    prefetch_depth: int
    io_threads: int
    context_length: int


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to know of the loaded model and what it may change."""

    path: Path
    name: str
    architecture: str
    n_layers: int
    n_experts: int                              # the most routed experts of a layer; 0 for a dense model
    top_k: int
    chat: bool                                  # it has a chat template
    max_context: int
    streaming: str                              # "experts", "layers" or "" (held whole)
    budget_range: tuple[int, int] | None        # (least, all experts held) bytes, when the budget can change
    fixed: Mapping[str, str]                    # setting name -> why it cannot change for this model
    settings: EngineSettings
    vocab_size: int = 0                         # token ids run from 0 to vocab_size - 1
    mtp: bool = False                           # its checkpoint ships MTP layers (it can draft with them)


@dataclass(frozen=True)
class LoadProgress:
    """Loading progress, fraction 0..1 (throttled; the last one always comes)."""

    request: int
    fraction: float
    message: str


@dataclass(frozen=True)
class ModelLoaded:
    """A model is ready to generate."""

    request: int
    info: ModelInfo
    atlas: Mapping[str, Any] | None             # the atlas sidecar when one is bound to this model


@dataclass(frozen=True)
class LoadFailed:
    """A load ended without its model; the message names the problem and the fix. `kept`: the model in use, still
    loaded (the new one failed or was cancelled before anything was closed), else None."""

    request: int
    message: str
    cancelled: bool = False
    kept: ModelInfo | None = None


@dataclass(frozen=True)
class ModelUnloaded:
    """The model was closed."""

    request: int


@dataclass(frozen=True)
class Generation:
    """An engine event of generation request `request` (ProgressEvent, TokenEvent, DoneEvent, ErrorEvent)."""

    request: int
    event: Event


@dataclass(frozen=True)
class SettingsApplied:
    """The answer to update_settings: the settings in force and the changes refused."""

    request: int                                # the last update_settings call it covers
    info: ModelInfo | None                      # the model with the settings now in force
    problems: tuple[str, ...] = ()              # changes refused, each naming why


@dataclass(frozen=True)
class AtlasProgress:
    """Atlas progress, fraction 0..1."""

    request: int
    fraction: float
    message: str


@dataclass(frozen=True)
class AtlasReady:
    """The atlas was computed and saved at `path`."""

    request: int
    path: Path
    atlas: Mapping[str, Any]


@dataclass(frozen=True)
class AtlasFailed:
    """The atlas could not be computed (or was cancelled: nothing was written)."""

    request: int
    message: str
    cancelled: bool = False


ServiceEvent = (LoadProgress | ModelLoaded | LoadFailed | ModelUnloaded | Generation | SettingsApplied
                | AtlasProgress | AtlasReady | AtlasFailed)
