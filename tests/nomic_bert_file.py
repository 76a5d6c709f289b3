"""A small Nomic BERT GGUF file (llama.cpp's `nomic-bert` architecture) with seeded random F32 weights and
a WordPiece vocabulary: the same bytes on every machine, so that the vectors llama.cpp's llama-embedding
computed for it (tests/data/nomic_bert_llamacpp.json, recorded by benchmarks/tools/record_nomic_bert.sh)
are the reference for PocketLLM's nomic-bert runtime. No Hugging Face class exists for it (its model
code is remote code), so llama.cpp is the anchor."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, HEADS, FF, LAYERS, CONTEXT, ROPE_BASE = 64, 4, 96, 2, 256, 1000.0
TEXTS = ["The word of the day is water.", "They could go UP, down, or over!", "what a day", "a"]


def write_nomic_bert(out: Path, tokenizer_dir: Path, seed: int = 11) -> Path:
    """The file at `out`, its vocabulary from the WordPiece tokenizer.json in `tokenizer_dir`."""
    from pocketllm.loaders.gguf_writer import wordpiece_vocab

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), "nomic-bert")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(2)
    wordpiece_vocab(tokenizer_dir, w)
    vocab = len(w.kv_data[0]["tokenizer.ggml.tokens"].value)

    def add(name: str, *shape: int, mean: float = 0.0, std: float = 0.08) -> None:
        w.add_tensor(name, (mean + std * rng.standard_normal(shape)).astype(np.float32))

    add("token_embd.weight", vocab, HIDDEN)
    add("token_types.weight", 2, HIDDEN)
    add("token_embd_norm.weight", HIDDEN, mean=1.0, std=0.1)
    add("token_embd_norm.bias", HIDDEN, std=0.1)
    for i in range(LAYERS):
        b = f"blk.{i}."
        add(b + "attn_qkv.weight", 3 * HIDDEN, HIDDEN)
        add(b + "attn_output.weight", HIDDEN, HIDDEN)
        add(b + "attn_output_norm.weight", HIDDEN, mean=1.0, std=0.1)
        add(b + "attn_output_norm.bias", HIDDEN, std=0.1)
        add(b + "ffn_up.weight", FF, HIDDEN)
        add(b + "ffn_gate.weight", FF, HIDDEN)
        add(b + "ffn_down.weight", HIDDEN, FF)
        add(b + "layer_output_norm.weight", HIDDEN, mean=1.0, std=0.1)
        add(b + "layer_output_norm.bias", HIDDEN, std=0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
