"""A model's config read from a file (a run's config.json, a checkpoint's, an imported model's):
every field checked before a LlamaConfig is made of it. Such a file may hold anything, and a
size nobody meant (-1, 10**400, "x") would otherwise fail deep inside torch, or allocate.
"""

import math

from model import LlamaConfig

SIZES = ("vocab_size", "max_position_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def checked(fields: dict) -> LlamaConfig:
    """LlamaConfig(**fields), each field first checked: sizes whole numbers a model can have
    (2**31: an embedding's index), the constants positive and finite. ValueError or TypeError
    (an unknown field) naming the field otherwise."""
    if not isinstance(fields, dict):
        raise TypeError(f"a model config is a JSON object, got {type(fields).__name__}")
    for name in SIZES:
        if name in fields and not (whole(fields[name]) and 1 <= fields[name] < 2**31):
            raise ValueError(f"{name} must be a positive integer below 2**31, got {str(fields[name])[:40]}")
    if fields.get("max_position_embeddings", 0) > 2**20:  # RoPE's tables hold them all: 1M positions, a GB
        raise ValueError(f"max_position_embeddings must be at most 2**20, got {fields['max_position_embeddings']}")
    for name in ("rms_norm_eps", "rope_theta"):
        if name in fields and not positive_number(fields[name]):
            raise ValueError(f"{name} must be a positive number, got {str(fields[name])[:40]}")
    head_dim = fields.get("head_dim")
    if head_dim is not None and not (whole(head_dim) and 2 <= head_dim < 2**16 and head_dim % 2 == 0):
        raise ValueError(f"head_dim must be an even positive integer (RoPE turns pairs), got {str(head_dim)[:40]}")
    if not isinstance(fields.get("tie_word_embeddings", False), bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {str(fields['tie_word_embeddings'])[:40]}")
    if fields.get("rope_scaling") is not None:
        check_rope_scaling(fields["rope_scaling"])
    config = LlamaConfig(**fields)
    if config.max_position_embeddings * config.head_dim > 2**26:  # RoPE's two fp32 tables, on every rank
        raise ValueError(f"max_position_embeddings x head_dim must be at most 2**26 (RoPE's tables: 512 MB), got "
                         f"{config.max_position_embeddings:,} x {config.head_dim:,}")
    for name in TOKEN_IDS:
        value = getattr(config, name)
        if value is not None and not (whole(value) and 0 <= value < config.vocab_size):
            raise ValueError(f"{name} must be a token id below vocab_size ({config.vocab_size}), got {str(value)[:40]}")
    seq_len = config.trained_seq_len
    if seq_len is not None and not (whole(seq_len) and 1 <= seq_len <= config.max_position_embeddings):
        raise ValueError(f"trained_seq_len must be a positive integer up to max_position_embeddings, got {seq_len!r}")
    return config


def check_rope_scaling(scaling) -> None:
    """Llama 3's scaling (model.llama3_inv_freq) is the one this model computes: any other is refused."""
    if not (isinstance(scaling, dict) and scaling.get("rope_type") == "llama3"):
        raise ValueError(f"rope_scaling: only Llama 3's (rope_type \"llama3\") is supported, got {str(scaling)[:80]}")
    for key in LLAMA3_SCALING:
        if not positive_number(scaling.get(key)):
            raise ValueError(f"rope_scaling's {key} must be a positive number, got {str(scaling.get(key))[:40]}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling's high_freq_factor must exceed its low_freq_factor")
