"""`colibri synth`: random-weight checkpoints and containers of real architectures, for benchmarks without downloads.

Modules: `shapes` (the shape table and each shape's config.json; the families' builders share `config`, the newer
families are in `families`), `checkpoint` (the Hugging Face folder: its plan, safetensors weights and trained
SentencePiece tokenizer), `container` (a quantized Colibri container written directly). Their public names are
imported from here.
"""

from app.bench.synth.checkpoint import (
    SynthPlan,
    TensorPlan,
    corpus_lines,
    plan_checkpoint,
    tensor_chunk,
    tokenizer_config,
    tokenizer_json,
    train_sentencepiece,
    write_checkpoint,
    write_tokenizer,
)
from app.bench.synth.container import ContainerPlan, plan_container, write_container
from app.bench.synth.shapes import DTYPES, SHAPES, config_for, get_shape, with_layers

__all__ = [
    "DTYPES", "SHAPES", "ContainerPlan", "SynthPlan", "TensorPlan", "config_for", "corpus_lines", "get_shape",
    "plan_checkpoint", "plan_container", "tensor_chunk", "tokenizer_config", "tokenizer_json", "train_sentencepiece",
    "with_layers", "write_checkpoint", "write_container", "write_tokenizer",
]
