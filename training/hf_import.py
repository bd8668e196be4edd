"""A published Llama in the Hugging Face format as --init-from's source: a folder of config.json,
tokenizer.json and safetensors weights (model.safetensors, or shards named by
model.safetensors.index.json), as transformers' save_pretrained writes and the Hub serves.

Its config.json becomes our LlamaConfig, or one line naming the field this model cannot represent.
Its tokenizer becomes the run's, and its own begin and end tokens frame the documents. Its weights
load in place: each parameter takes, from the file, only the part this rank holds (FSDP's rows,
TP's columns), so no rank reads the whole model. Nothing read is trusted: shapes and dtypes are
checked against the model from the files' headers before anything is allocated, values for
finiteness once loaded.
"""

import json
import os
import re
from pathlib import Path

import torch

from model import LlamaConfig
from training import corpus, model_config
from training.errors import UsageError, first_line

CONFIG, TOKENIZER, WEIGHTS, INDEX = "config.json", "tokenizer.json", "model.safetensors", "model.safetensors.index.json"
# transformers' LlamaConfig defaults, for a field a config.json leaves out (as transformers reads it)
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False}
# Fields whose value this model computes only one way: anything else is refused, naming the field
ONLY = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "sliding_window": None,
        "use_sliding_window": False, "pretraining_tp": 1, "attention_dropout": 0.0}
# What a RoPE description may hold (transformers 5's rope_parameters, 4.x's rope_scaling)
ROPE_KEYS = {"rope_type", "type", "rope_theta", *model_config.LLAMA3_SCALING}


# What a Hub model's folder holds that --init-from reads (not its other formats: .bin, .gguf, ...)
HUB_FILES = [CONFIG, "generation_config.json", TOKENIZER, "model*.safetensors", INDEX]  # not original/, onnx/
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve(source: str) -> Path | None:
    """--init-from's Hugging Face model, as a local folder: the folder given, or a Hub id
    (ORG/NAME) where no such path exists, fetched once (its config, tokenizer and safetensors
    only) at the commit its main branch names now. The folder huggingface_hub gives is
    .../snapshots/<commit>: recorded as --init-from in the run, the commit is. None: not a
    Hugging Face model."""
    path = Path(source).expanduser()
    if os.path.lexists(path) or not REPO_ID.fullmatch(source):
        return path if is_hf_folder(path) else None
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(source, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, an unknown id, a gated model without a token, a failed download
        raise UsageError(f"--init-from {source}: no such folder here, and the Hugging Face Hub did not give that "
                         f"model ({first_line(e)[:200]})") from None


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: its config.json names a model_type (ours never does)."""
    try:
        fields = read_json(path / CONFIG, "model config", CONFIG_BYTES) if os.path.isfile(path / CONFIG) else None
    except (UsageError, OSError):
        return False
    return isinstance(fields, dict) and "model_type" in fields


CONFIG_BYTES = 2**20  # a config.json holds a few KB (run_folder reads ours with the same bound)


def read_json(path: Path, what: str, limit: int = 2**26):  # (an index of 100,000 weights: a few MB)
    try:
        return json.loads(corpus.read_text(path, what, limit))
    except (ValueError, RecursionError) as e:
        raise UsageError(f"cannot read {path}: {first_line(e)}") from None


def llama_config(folder: Path) -> LlamaConfig:
    """Our config of the model in folder/config.json, its special tokens included."""
    hf = read_json(folder / CONFIG, "model config", CONFIG_BYTES)
    if not isinstance(hf, dict):
        raise UsageError(f"{folder / CONFIG} is not a JSON object")
    if hf.get("model_type") != "llama":
        raise UsageError(f"{folder / CONFIG}: model_type {json.dumps(hf.get('model_type'))[:40]} is not a Llama; this "
                         "trainer imports model_type \"llama\" only")
    for field, value in ONLY.items():
        if hf.get(field, value) != value:
            raise UsageError(f"{folder / CONFIG}: {field} {json.dumps(hf[field])[:40]} is not what this model computes "
                             f"({json.dumps(value)})")
    rope, rope_type = rope_description(folder, hf)
    if rope_type not in ("default", "llama3"):
        raise UsageError(f"{folder / CONFIG}: RoPE scaling {json.dumps(rope_type)[:40]} is not supported (only "
                         "Llama 3's, \"llama3\", and none)")
    fields = {name: hf.get(name, DEFAULTS.get(name)) for name in
              ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "head_dim")}
    kv_heads = hf.get("num_key_value_heads")  # absent or null: one a query head (0 is refused, not defaulted)
    fields["num_key_value_heads"] = fields["num_attention_heads"] if kv_heads is None else kv_heads
    fields["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", DEFAULTS["rope_theta"]))
    if rope_type == "llama3":
        fields["rope_scaling"] = {"rope_type": "llama3", **{k: rope.get(k) for k in model_config.LLAMA3_SCALING}}
    generation = folder / "generation_config.json"
    generation = read_json(generation, "generation config") if os.path.lexists(generation) else {}
    for name in model_config.TOKEN_IDS:  # config.json's, else generation_config.json's
        value = hf.get(name)
        if value is None and isinstance(generation, dict):
            value = generation.get(name)
        fields[name] = value[0] if isinstance(value, list) and value else value  # Llama 3.1's eos: a list
    if isinstance(fields["pad_token_id"], int) and fields["pad_token_id"] < 0:  # older Llama configs' -1: none
        fields["pad_token_id"] = None
    if fields["bos_token_id"] is None or fields["eos_token_id"] is None:
        raise UsageError(f"{folder / CONFIG} names no bos_token_id or no eos_token_id: the documents are framed "
                         "with the model's own begin and end tokens, and this model has none to give")
    try:
        return model_config.checked(fields)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{folder / CONFIG}: {first_line(e)}") from None


def rope_description(folder: Path, hf: dict) -> tuple[dict, str]:
    """config.json's RoPE: transformers 5 writes rope_parameters (rope_theta within), 4.x
    rope_theta and rope_scaling. Read whole or refused: a key we do not compute (a partial
    rotary factor, per-layer parameters), scaling without a type, two that disagree."""
    described = [hf[key] for key in ("rope_parameters", "rope_scaling") if hf.get(key) is not None]
    for rope in described:
        if not isinstance(rope, dict):
            raise UsageError(f"{folder / CONFIG}: rope_parameters and rope_scaling must be JSON objects")
        if unknown := sorted(set(rope) - ROPE_KEYS):
            raise UsageError(f"{folder / CONFIG}: RoPE's {json.dumps(unknown[0])[:60]} is not something this model "
                             "computes")
        if "factor" in rope and "rope_type" not in rope and "type" not in rope:
            raise UsageError(f"{folder / CONFIG}: RoPE scaling without a rope_type")
    kinds = {rope.get("rope_type", rope.get("type", "default")) for rope in described}
    if len(kinds) > 1:
        raise UsageError(f"{folder / CONFIG}: rope_parameters and rope_scaling disagree ({', '.join(sorted(kinds))})")
    return (described[0] if described else {}), (kinds.pop() if kinds else "default")


def our_name(name: str) -> str:
    """A weight's name in our model, from its name in a Hugging Face file: model. -> base_model."""
    return "base_model." + name.removeprefix("model.") if name.startswith("model.") else name


def hf_name(name: str) -> str:
    return "model." + name.removeprefix("base_model.") if name.startswith("base_model.") else name


def weights(folder: Path) -> dict:
    """Every weight in the folder's safetensors, by our name: a slice of its memory-mapped file
    (safe_open reads a file's header alone, and a slice only the part asked for). Sharded, each
    file is the one the index names for it, and holds it."""
    from safetensors import safe_open
    if os.path.isfile(folder / INDEX):  # sharded: the index names each weight's file
        index = read_json(folder / INDEX, "weights index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UsageError(f"{folder / INDEX} has no weight_map of names to files")
        files = {name: folder / file for name, file in weight_map.items()}
        outside = next((f for f in files.values() if f.parent != folder), None)
        if outside is not None:  # "../../etc/passwd": only the folder's own files are read
            raise UsageError(f"{folder / INDEX} names {outside.name[:80]} outside the folder")
        missing = next((f for f in files.values() if not os.path.isfile(f)), None)
        if missing is not None:
            raise UsageError(f"{folder / INDEX} names {missing.name[:80]}, which is not in {folder}")
    elif os.path.lexists(folder / WEIGHTS):  # one file: whatever is there is read as one must be
        files = None
    else:
        raise UsageError(f"--init-from {folder}: no {WEIGHTS} and no {INDEX}: where are the weights?")
    opened = {}
    for path in sorted(set(files.values())) if files is not None else [folder / WEIGHTS]:
        corpus.regular_file(path, "weights")
        try:
            opened[path] = safe_open(path, "pt")
        except Exception as e:  # SafetensorError: a truncated or damaged file
            raise UsageError(f"{path} is damaged: {first_line(e)}") from None
    found = {}
    for path, f in opened.items():
        for name in f.keys():  # every tensor of every file, listed in the index or not
            if files is not None and files.get(name) != path:
                raise UsageError(f"{path} holds {name[:80]}, which {INDEX} says is in "
                                 f"{files[name].name if name in files else 'no file'}")
            if our_name(name) in found:  # model.x and base_model.x: two values for one weight
                raise UsageError(f"{path}: {name[:80]} is there twice, under two names")
            found[our_name(name)] = (name, f)
    if files is not None and (unlisted := next((n for n in files if our_name(n) not in found), None)):
        raise UsageError(f"{folder / INDEX} says {files[unlisted].name} holds {unlisted[:80]}, which it does not")
    return {name: f.get_slice(hf) for name, (hf, f) in found.items()}


def check_weights(folder: Path, config: LlamaConfig, expected: dict[str, torch.Size]) -> None:
    """Every weight the model needs, in the shape it needs, floating point: from the files'
    headers, before anything is allocated. A tied model's LM head is its embedding (the files
    may hold a copy, as some do, which transformers ignores too); RoPE's tables are computed
    (an old file's inv_freq is not read)."""
    pieces = {name: piece for name, piece in weights(folder).items() if not name.endswith("rotary_emb.inv_freq")}
    needed = {name: shape for name, shape in expected.items()
              if not (config.tie_word_embeddings and name == "lm_head.weight")}
    for name, shape in needed.items():
        if name not in pieces:
            raise UsageError(f"--init-from {folder}: its weights lack {hf_name(name)}")
        piece = pieces[name]
        if tuple(piece.get_shape()) != tuple(shape) or piece.get_dtype() not in ("BF16", "F16", "F32", "F64"):
            raise UsageError(f"--init-from {folder}: {hf_name(name)} is {piece.get_dtype()} "
                             f"{tuple(piece.get_shape())}, and the model's config.json makes it {tuple(shape)}")
    if extra := sorted(set(pieces) - set(expected)):
        raise UsageError(f"--init-from {folder}: its weights hold {hf_name(extra[0])[:80]}, which this model has "
                         "no place for (a bias, another architecture?)")


@torch.no_grad()
def load_into(model: torch.nn.Module, folder: Path) -> int:
    """The folder's weights into the model's parameters, in place and cast to their dtype: a
    sharded parameter (a DTensor: FSDP, TP) reads only its own part of the file. Returns the
    elements read, which a test holds to one rank's share."""
    from torch.distributed.tensor import DTensor
    pieces, read = weights(folder), 0
    for name, param in model.named_parameters():  # a tied LM head is the embedding's parameter, named once
        target, index = param, tuple(slice(None) for _ in param.shape)
        if isinstance(param, DTensor):  # this rank's block of the whole tensor: rows (FSDP), columns (TP)
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            target = param.to_local()
        value = pieces[name][index]
        read += value.numel()
        target.copy_(value)
    return read
