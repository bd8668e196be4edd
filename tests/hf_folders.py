"""Hugging Face Llama folders as the published ones are laid out, written here by transformers
itself (random weights, no network): config.json, bf16 safetensors (one file, or shards with
their index) and a tokenizer.json with the model's own special tokens. Three shapes, each of a
family --init-from must read:

- "smollm": SmolLM2's: tied input and output embeddings, its one <|endoftext|> both begins and
  ends a document (bos = eos = 0), no pad token, rope_theta 100000, 3 query heads to 1 key/value.
- "llama3": Llama 3's: RoPE frequency scaling ("llama3", an original context of 16 positions, so
  that the scaling changes every test's sequence), <|begin_of_text|> and <|end_of_text|> after
  the vocabulary's last merge (ids 1022 and 1023 of a 1024-token vocabulary: a 128k one scaled
  down), rope_theta 500000, untied.
- "head_dim": an explicit head_dim (32) unlike hidden_size / heads (16), Llama 2's <s> and </s>.
"""

import os
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SHAPES = {
    "smollm": dict(model=dict(hidden_size=48, intermediate_size=128, num_hidden_layers=2, num_attention_heads=3,
                              num_key_value_heads=1, tie_word_embeddings=True, rope_theta=100000.0,
                              max_position_embeddings=256, rms_norm_eps=1e-5),
                   vocab=400, first=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], last=[],
                   bos="<|endoftext|>", eos="<|endoftext|>"),
    "llama3": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}),
                   vocab=1024, first=[], last=["<|begin_of_text|>", "<|end_of_text|>"],
                   bos="<|begin_of_text|>", eos="<|end_of_text|>"),
    "head_dim": dict(model=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, max_position_embeddings=256),
                     vocab=512, first=["<unk>", "<s>", "</s>"], last=[], bos="<s>", eos="</s>"),
}


def texts(corpus: Path) -> list[str]:
    """The test corpus, then Python's own modules: enough text for a 1024-token BPE."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return corpus.read_text().splitlines() + [(stdlib / name).read_text() for name in
                                              ("argparse.py", "dataclasses.py", "inspect.py")]


def tokenizer(shape: str, corpus: Path) -> Tokenizer:
    """A byte-level BPE of exactly the shape's vocabulary size, its special tokens where the
    family has them: SmolLM2 and Llama 2 first, Llama 3 after every merge (and its post-processor
    begins each encoding with <|begin_of_text|>, as Llama 3's does)."""
    spec = SHAPES[shape]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"] - len(spec["last"]), special_tokens=spec["first"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts(corpus), trainer)
    bpe.add_special_tokens(spec["last"])
    assert bpe.get_vocab_size() == spec["vocab"], bpe.get_vocab_size()
    if shape == "llama3":
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{spec['bos']} $A", special_tokens=[(spec["bos"], bpe.token_to_id(spec["bos"]))])
    return bpe


def hf_config(shape: str, tok: Tokenizer):
    from transformers import LlamaConfig
    spec = SHAPES[shape]
    return LlamaConfig(vocab_size=spec["vocab"], bos_token_id=tok.token_to_id(spec["bos"]),
                       eos_token_id=tok.token_to_id(spec["eos"]), pad_token_id=None, **spec["model"])


def write(folder: Path, shape: str, corpus: Path, sharded: bool = False, seed: int = 0) -> Path:
    """A model folder as save_pretrained writes it (bf16 safetensors), with its tokenizer.json."""
    from transformers import LlamaForCausalLM
    tok = tokenizer(shape, corpus)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(shape, tok)).to(torch.bfloat16)
    # sharded: a few tensors a file (max_shard_size in bytes), as the Hub's larger models come
    model.save_pretrained(folder, max_shard_size=40_000 if sharded else "10GB")
    tok.save(str(folder / "tokenizer.json"))
    assert (folder / "model.safetensors.index.json").exists() == sharded, os.listdir(folder)
    return folder
