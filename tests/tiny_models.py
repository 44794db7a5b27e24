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
