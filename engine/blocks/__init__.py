"""Building blocks shared by every model family: norms, RoPE, attention (GQA and MLA), MLP, MoE."""
