"""Tiny models with random weights and a small trained tokenizer: tests download nothing."""
from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Once upon a time a brave knight walked to the castle gate with a sword.",
    "The dragon slept in the forest, dreaming of gold, potions and old skeletons.",
    "Write a short story about a dragon, a gate and a potion.",
    "The wizard opened the book and read the spell aloud to the crowd of players.",
    "Hello world! Numbers 0123456789, punctuation .,;:!?'\"()-- and a café.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # Byte-level BPE: any text encodes, and decoding gives it back exactly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(kind: str, vocab_size: int, seed: int = 0, eos_id: int = 0, pad_id: int = 3):
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)
        return GPT2LMHeadModel(config).eval()
    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, bos_token_id=eos_id, eos_token_id=eos_id,
                             pad_token_id=pad_id)
        return LlamaForCausalLM(config).eval()
    raise ValueError(kind)


def save_tiny(kind: str, directory: str, seed: int = 0) -> str:
    """A tiny `kind` model and its tokenizer, saved as a local Hugging Face directory."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(kind, len(tokenizer), seed, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# One tiny model per family the continuous engine runs (issue: "the model a game ships"), each
# with the family's own quirks switched on: llama3 rope scaling and a separate head, a sliding
# window, q/k/v biases, q/k norms, Gemma 3's scaled embeddings, extra norms, GELU-tanh and its mix
# of local and global layers, Phi-3's fused projections and partial rotary. Dimensions are
# multiples of 256 so that llama.cpp's quantizer can make K-quants of every matrix (QK_K = 256)
# instead of falling back to other types.
FAMILY_DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


def family_config(kind: str, vocab_size: int, eos_id: int, pad_id: int, bos_id: int | None = None):
    """transformers' config of a tiny `kind` model (one of FAMILIES)."""
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)
    ids = dict(vocab_size=vocab_size, bos_token_id=eos_id if bos_id is None else bos_id,
               eos_token_id=eos_id, pad_token_id=pad_id)
    common = dict(FAMILY_DIMS, **ids)
    if kind == "llama":  # Llama 3.2's shape: llama3 rope scaling; a head of its own
        return LlamaConfig(**common, head_dim=64, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64))
    if kind == "mistral":
        return MistralConfig(**common, head_dim=64, sliding_window=24, tie_word_embeddings=False)
    if kind == "qwen2":  # biases on q, k and v; tied head (Qwen2.5-0.5B)
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="default", rope_theta=1000000.0))
    if kind == "qwen3":  # q/k norms; head_dim wider than hidden / heads
        return Qwen3Config(**common, head_dim=96, tie_word_embeddings=True)
    if kind == "gemma3":  # local (sliding) and global layers, each with a rope of its own: 6 layers,
        # the last global, Gemma 3's own pattern, which is all a GGUF file can say (llama.cpp takes
        # every 6th layer as global): its file is then the same model as its directory
        return Gemma3TextConfig(**dict(common, num_hidden_layers=6), head_dim=64, sliding_window=16,
                                query_pre_attn_scalar=64, tie_word_embeddings=True)
    if kind == "phi3":  # fused qkv and gate_up; rotary over part of each head (Phi-4-mini: 0.75)
        return Phi3Config(**common, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                         partial_rotary_factor=0.75),
                          tie_word_embeddings=False)
    raise ValueError(kind)


def family_model(kind: str, tokenizer, seed: int = 0):
    """A tiny `kind` model with random weights for `tokenizer`'s vocabulary, in float32."""
    from transformers import AutoModelForCausalLM
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = family_config(kind, len(tokenizer), eos, pad)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms, not all ones: a norm applied wrongly (or not) shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_family(kind: str, directory: str, tokenizer, seed: int = 0) -> str:
    """A tiny `kind` model and `tokenizer` (SmolLM2's, for the families' tests), saved as a local
    Hugging Face directory of safetensors."""
    model = family_model(kind, tokenizer, seed)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
