"""Export a trained model to the Hugging Face format, for the tools of the Llama ecosystem.

    python tools/export_hf.py out out-hf

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("out-hf")
    tokenizer = AutoTokenizer.from_pretrained("out-hf")   # a PreTrainedTokenizerFast

Our model is the Llama architecture with Llama's parameter names, so the export is a
renaming (`base_model.` becomes `model.`) plus the files transformers reads: config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json and
generation_config.json. It needs the `safetensors` package, not transformers itself.
The folder is written next to HF_DIR and renamed into place when complete.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from safetensors.torch import save
from tokenizers import Tokenizer, processors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from data import special_ids  # noqa: E402
from model import LlamaForPretraining  # noqa: E402
from training import errors, hf_import, run_folder, stopping, weights  # noqa: E402
from training.errors import UsageError, path_argument  # noqa: E402


def hf_config(model: LlamaForPretraining, tokenizer: Tokenizer) -> dict:
    """transformers' LlamaConfig for our model, whose max_position_embeddings is the context
    it was trained at (an imported model's: the context it came with, which a run at a shorter
    --seq-len leaves it)."""
    c = model.config
    imported = c.own_special_tokens
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:  # Llama 3's
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings if imported else c.trained_context,
        "rms_norm_eps": c.rms_norm_eps, **hf_import.ONLY, "tie_word_embeddings": c.tie_word_embeddings,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta and rope_scaling: all, for both
        "rope_theta": c.rope_theta, "rope_parameters": rope, "rope_scaling": c.rope_scaling,
        **special_token_ids(model, tokenizer), "torch_dtype": "float32",
    }


def special_token_ids(model: LlamaForPretraining, tokenizer: Tokenizer) -> dict:
    bos, eos, pad = special_ids(tokenizer, model.config)  # [BOT], [EOT], [PAD], or an imported model's own
    if model.config.own_special_tokens:  # imported: its own pad token, or none (Llama 3)
        pad = model.config.pad_token_id
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def hf_state_dict(model: LlamaForPretraining) -> dict:
    """Our parameter names with transformers' prefix; every tensor its own contiguous copy,
    as safetensors requires. A tied LM head is the embedding: written once, as transformers does."""
    tied = model.config.tie_word_embeddings
    return {hf_import.hf_name(name): t.detach().contiguous().clone()
            for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}


def hf_tokenizer(tokenizer: Tokenizer, bos: int) -> Tokenizer:
    """Our tokenizer, plus a rule that starts every encoding with its begin token (bos), as
    training framed documents: `tokenizer(text)` in transformers then gives exactly what the
    model saw."""
    hf, token = Tokenizer.from_str(tokenizer.to_str()), tokenizer.id_to_token(bos)
    hf.post_processor = processors.TemplateProcessing(single=f"{token} $A", pair=f"{token} $A {token} $B:1",
                                                      special_tokens=[(token, bos)])
    return hf


# What an export writes: an unfinished one (.NAME.partial) holding these alone is ours to replace
EXPORT_FILES = {"model.safetensors", "tokenizer.json", "config.json", "generation_config.json",
                "tokenizer_config.json", "special_tokens_map.json"}


def export(out_dir: str, hf_dir: str):
    hf = Path(hf_dir)
    if os.path.lexists(hf) and (hf.is_symlink() or not (hf.is_dir() and not any(hf.iterdir()))):
        raise UsageError(f"{hf} already exists: choose a new folder (nothing was written)")
    run_folder.check_writable(hf_dir, "the export folder")  # e.g. not under a regular file
    partial = hf.with_name(f".{hf.name}.partial")  # complete, or not there at all
    if os.path.lexists(partial):  # an export that was interrupted; anything else there is not ours to delete
        if partial.is_symlink() or not partial.is_dir() or not {p.name for p in partial.iterdir()} <= EXPORT_FILES:
            raise UsageError(f"{partial} is in the way, and is not an unfinished export: move it away (nothing was "
                             "written)")
    model, tokenizer = weights.load_trained(out_dir)
    ids = special_token_ids(model, tokenizer)
    tokens = {name.removesuffix("_id"): tokenizer.id_to_token(i)  # "bos_token": "[BOT]"
              for name, i in ids.items() if i is not None}
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(save(hf_state_dict(model), metadata={"format": "pt"}))
    hf_tokenizer(tokenizer, ids["bos_token_id"]).save(str(partial / "tokenizer.json"))
    files = {
        "config.json": hf_config(model, tokenizer),
        "generation_config.json": ids,  # generate() stops at [EOT] (an imported model: its own end token)
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **tokens,
                                  "model_max_length": model.config.trained_context,  # longer inputs get a warning
                                  "clean_up_tokenization_spaces": False,  # decode exactly as ours does
                                  "split_special_tokens": True},  # "[EOT]" in a text is text, as in training
        "special_tokens_map.json": tokens,
    }
    for name, content in files.items():
        (partial / name).write_text(json.dumps(content, indent=2) + "\n")
    if hf.exists():
        hf.rmdir()  # empty (checked above)
    os.rename(partial, hf)
    print(f"wrote {hf}: {model.num_parameters() / 1e6:.1f}M parameters; load it with "
          f"LlamaForCausalLM.from_pretrained({str(hf)!r})")


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=path_argument, help="output folder of a training run")
    parser.add_argument("hf_dir", type=path_argument, help="new folder for the Hugging Face files")
    args = parser.parse_args(argv)
    export(args.out_dir, args.hf_dir)


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
