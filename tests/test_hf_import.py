"""--init-from a Hugging Face Llama: what transformers computes with the published model, ours
computes with the imported one, at every rung, and exports back unchanged.

The models are written here by transformers (tests/hf_folders.py: random bf16 weights, no
network), one of each family the issue names: SmolLM2's tied embeddings, Llama 3's RoPE scaling
and vocabulary ending in its special tokens, an explicit head_dim; one file and sharded.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

import hf_folders
from conftest import (REPO, assert_same_metrics, assert_same_model, assert_same_weights, assert_within,
                      load_weights, measure_floor, train)
from test_bad_inputs import refused_in_process

sys.path.insert(0, str(REPO / "tools"))
transformers = pytest.importorskip("transformers")

# 4 steps of 8 sequences of 32 tokens, fp32: a checkpoint at step 2 to resume from
HF_FAST = ["--seq-len", "32", "--batch-size", "8", "--max-steps", "4", "--warmup-steps", "1", "--log-every", "1",
           "--eval-every", "2", "--save-every", "2", "--val-docs", "9", "--dtype", "fp32"]
SHARDED = {"head_dim"}  # the others are one model.safetensors


@pytest.fixture(scope="session")
def hf(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {shape: hf_folders.write(root / shape, shape, corpus, sharded=shape in SHARDED)
            for shape in hf_folders.SHAPES}


def imported(folder: Path):
    """The folder's model as --init-from builds it, in one process."""
    from model import LlamaForPretraining
    from training import hf_import, weights
    config = hf_import.llama_config(folder)
    hf_import.check_weights(folder, config, weights.model_shapes(config))
    model = LlamaForPretraining(config).eval()
    hf_import.load_into(model, folder)
    return model


def published(folder: Path, attention: str = "sdpa"):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation=attention).eval()


@pytest.mark.parametrize("shape", list(hf_folders.SHAPES))
@torch.no_grad()
def test_our_logits_and_greedy_generation_are_transformers(hf, shape):
    """fp32, on sequences longer than the Llama 3 shape's original context (16): to the bit here;
    anywhere within 4x what transformers' own two attention kernels differ by, measured now."""
    from generate import generate
    ours, theirs = imported(hf[shape]), published(hf[shape])
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    logits, expected = ours(ids), theirs(ids).logits
    if not torch.equal(logits, expected):
        floor = (published(hf[shape], "eager")(ids).logits - expected).abs().max().item()
        assert_within("logits", (logits - expected).abs().max().item(), floor, 4)
    prompt = ids[0, :8]
    greedy = theirs.generate(prompt[None], max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=ours.config.eos_token_id)[0, 8:].tolist()
    assert generate(ours, prompt.tolist(), 32) == greedy


@pytest.mark.parametrize("shape", list(hf_folders.SHAPES))
def test_import_then_export_gives_back_the_same_tensors_and_model(hf, shape, tmp_path):
    """Exported from a run's folder (config.json, tokenizer.json, model.pt), the imported model
    is the published one again: each tensor equal (bf16 widened to fp32 exactly), a tied model's
    LM head left out as transformers leaves it, a config transformers reads as the original's,
    and its tokenizer begins a text with the model's own begin token, as training framed it."""
    from safetensors.torch import load_file

    import export_hf
    from training import run_folder, tokenized
    model = imported(hf[shape])
    out = tmp_path / "out"
    run_folder.write_run_files(str(out), tokenized.load_tokenizer(hf[shape] / "tokenizer.json", model.config), model)
    run_folder.save_model(str(out), model.state_dict())
    export_hf.export(str(out), str(tmp_path / "export"))

    original = {}
    for file in sorted(hf[shape].glob("*.safetensors")):
        original.update(load_file(file))
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name].float()) for name in original)
    again, theirs = published(tmp_path / "export"), published(hf[shape])
    for field in ("tie_word_embeddings", "head_dim", "rope_parameters", "bos_token_id", "eos_token_id",
                  "pad_token_id", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(again.config, field) == getattr(theirs.config, field), field
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer("def f").input_ids[0] == model.config.bos_token_id


def hf_args(folder: Path, corpus: Path, out: Path, *extra) -> list[str]:
    return ["--init-from", str(folder), "--dataset", str(corpus), *HF_FAST, "--out-dir", str(out), *extra]


def tied(run: Path) -> bool:
    weights = load_weights(run)
    return torch.equal(weights["lm_head.weight"], weights["base_model.embed_tokens.weight"])


def test_an_imported_tied_model_trains_alike_under_dp_ddp_and_fsdp_and_stays_tied(hf, corpus, tmp_path):
    """SmolLM2's shape, 4 steps from its weights: DDP and FSDP on 2 ranks, and one process
    compiled, end with the weights and log the losses of one process, within 20x the rounding
    floor of these runs (the same run with its micro-batches reversed); the LM head is still the
    embedding in every model.pt, and each FSDP rank read only its own half of the weights from
    the files."""
    folder = hf["smollm"]
    one = tmp_path / "dp"
    train("train_dp.py", hf_args(folder, corpus, one))
    reordered = tmp_path / "dp_reversed"
    train("train_dp.py", hf_args(folder, corpus, reordered), perturb="reverse-batches")
    floor = measure_floor(one, reordered)
    ddp, fsdp, spies = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "spies"
    train("train_ddp.py", hf_args(folder, corpus, ddp), nproc=2)
    spies.mkdir()
    train("train_fsdp.py", hf_args(folder, corpus, fsdp), nproc=2, spy_dir=spies)
    compiled = tmp_path / "compiled"
    train("train_dp.py", hf_args(folder, corpus, compiled, "--compile"))
    for run in (ddp, fsdp, compiled):
        assert_same_weights(one, run, floor)
        assert_same_metrics(one, run, floor)
    assert all(tied(run) for run in (one, ddp, fsdp, compiled))
    # every element once over the two ranks, none twice on one (the whole model: 2x their share)
    read = [json.loads((spies / f"rank{rank}.json").read_text())["weights_read"] for rank in (0, 1)]
    elements = sum(t.numel() for name, t in load_weights(one).items() if name != "lm_head.weight")
    assert sum(read) == elements and max(read) <= elements // 2 + 1000, (read, elements)


@pytest.mark.parametrize("script, nproc, shape", [("train_dp.py", 0, "llama3"), ("train_fsdp.py", 2, "llama3"),
                                                 ("train_fsdp.py", 2, "smollm")])
def test_an_imported_run_resumes_bitwise(hf, corpus, tmp_path, script, nproc, shape):
    """Stopped at step 2 and resumed without --init-from (its config.json says what it is), an
    imported run ends where the run that never stopped ends: every weight and logged row, bitwise;
    under FSDP a tied model's sharded checkpoints too."""
    folder = hf[shape]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(script, hf_args(folder, corpus, whole), nproc)
    train(script, hf_args(folder, corpus, stopped, "--stop-at-step", "2"), nproc)
    resume = hf_args(folder, corpus, stopped, "--resume")[2:]  # no --init-from
    train(script, resume, nproc)
    assert_same_model(whole, stopped)


def test_documents_are_framed_with_the_models_own_tokens(hf, corpus):
    """Llama 3's tokenizer: every document begins with <|begin_of_text|> and ends with
    <|end_of_text|> (ids 1022 and 1023), as the model was pretrained; padding's targets are
    ignored whatever pads them."""
    from model import IGNORE_INDEX
    from training import config, run_data
    cfg = config.parse_args(hf_args(hf["llama3"], corpus, Path("unused")))
    documents = run_data.Corpus(cfg)
    tokenizer = run_data.get_tokenizer(cfg, None, resuming=False)
    rows = documents.training_rows(tokenizer)
    x = torch.stack([rows[i][0] for i in range(len(rows))])
    y = torch.stack([rows[i][1] for i in range(len(rows))])
    starts = x[:, 0] == 1022
    assert int(starts.sum()) == len(documents.train_text) == int((y == 1023).sum())
    assert not (x[:, 1:] == 1022).any()  # a begin token starts a document, nowhere else
    real = y != IGNORE_INDEX
    assert (real[:, :-1] | ~real[:, 1:]).all()  # real targets first, then only padding


def poison(folder: Path):
    """One weight of the file NaN: what a diverged run's export, or a damaged copy, may hold."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def write_config(folder: Path, **change):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))


def copy_of_file(file: Path, folder: Path):
    (folder / file.name).write_bytes(file.read_bytes())


def copy_of(folder: Path, to: Path) -> Path:
    import shutil
    return Path(shutil.copytree(folder, to))


def drop(folder: Path, name: str):
    """A weight taken out of the one file: a model whose files lack one."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def misfile(folder: Path):
    """The index names another shard for one weight than the one that holds it."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def truncate(file: Path):
    file.write_bytes(file.read_bytes()[:-10])


# case: (the model it starts from, what is done to it, what the one line says)
HOSTILE = {
    "no config.json": ("smollm", lambda f, hf: (f / "config.json").unlink(),
                       "or a Hugging Face model's folder: its safetensors have no config.json beside them"),
    "no weights": ("smollm", lambda f, hf: [p.unlink() for p in f.glob("model*.safetensors*")],
                   "no model.safetensors and no model.safetensors.index.json"),
    "a truncated file": ("smollm", lambda f, hf: truncate(f / "model.safetensors"), "model.safetensors is damaged"),
    "an index naming another shard": ("head_dim", lambda f, hf: misfile(f),
                                      "holds model.norm.weight, which model.safetensors.index.json says is in"),
    "an untied model without its LM head": ("llama3", lambda f, hf: drop(f, "lm_head.weight"),
                                            "its weights lack lm_head.weight"),
    "NaN weights": ("smollm", lambda f, hf: poison(f), "its weights are not all finite (NaN or inf)"),
    "biases": ("smollm", lambda f, hf: write_config(f, attention_bias=True),
               "attention_bias true is not what this model computes"),
    "another model": ("smollm", lambda f, hf: write_config(f, model_type="mistral"),
                      "model_type \"mistral\" is not a Llama"),
    "another activation": ("smollm", lambda f, hf: write_config(f, hidden_act="gelu"), "hidden_act \"gelu\""),
    "sliding windows": ("smollm", lambda f, hf: write_config(f, sliding_window=64), "sliding_window 64"),
    "another rope scaling": ("smollm", lambda f, hf: write_config(f, rope_parameters={"rope_type": "yarn"}),
                             "RoPE scaling \"yarn\" is not supported"),
    "RoPE by layer type": ("llama3", lambda f, hf: write_config(f, rope_parameters={"full_attention": {}}),
                           "RoPE's \"full_attention\" is not something this model computes"),
    "RoPE tables no memory holds": ("smollm", lambda f, hf: write_config(f, max_position_embeddings=2**20,
                                                                          head_dim=128),
                                    "max_position_embeddings x head_dim must be at most 2**26"),
    "another model's tokenizer": ("smollm", lambda f, hf: copy_of_file(hf["head_dim"] / "tokenizer.json", f),
                                  "has 512 tokens, and the model 400 embedding rows (config.json): the tokenizer "
                                  "of another run or model?"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_model_folder_is_one_line_and_nothing_written(hf, corpus, tmp_path, capsys, case):
    """Each refused before anything is written, in one line naming the file or field."""
    shape, change, message = HOSTILE[case]
    folder = copy_of(hf[shape], tmp_path / "model")
    change(folder, hf)
    out = tmp_path / "out"
    refused_in_process("train_dp.py", hf_args(folder, corpus, out)[:-2], out, message, capsys)


def test_an_abbreviated_model_flag_is_no_way_around_the_architecture(hf, corpus, tmp_path, capsys):
    """argparse would take --mode for --model: the flags are spelled out, or refused."""
    out = tmp_path / "out"
    refused_in_process("train_dp.py", [*hf_args(hf["llama3"], corpus, out)[:-2], "--mode", "debug"], out,
                       "unrecognized arguments: --mode debug", capsys)


def test_a_config_edited_to_tie_an_untied_run_is_one_line(hf, corpus, tmp_path, capsys):
    """An untied run's config.json edited to tie_word_embeddings true would load one of its two
    matrices as both in silence (load_state_dict into the tied model): export, generate and
    --init-from refuse it."""
    import export_hf
    from training.errors import UsageError
    run = tmp_path / "run"
    train("train_dp.py", hf_args(hf["llama3"], corpus, run, "--max-steps", "2"))
    write_config(run, tie_word_embeddings=True)
    capsys.readouterr()  # the run's own progress bar
    with pytest.raises(UsageError, match="differs from the embedding: an untied model's"):
        export_hf.export(str(run), str(tmp_path / "export"))
    out = tmp_path / "again"
    refused_in_process("train_dp.py", hf_args(run, corpus, out)[:-2], out, "differs from the embedding", capsys)


def test_an_index_naming_a_missing_shard_is_one_line(hf, corpus, tmp_path, capsys):
    folder = copy_of(hf["head_dim"], tmp_path / "model")
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    out = tmp_path / "out"
    refused_in_process("train_dp.py", hf_args(folder, corpus, out)[:-2], out, "which is not in", capsys)


def test_a_hub_id_without_a_network_is_one_line(corpus, tmp_path, capsys):
    """HF_HUB_OFFLINE (conftest): huggingface_hub refuses at once, as it would time out offline."""
    out = tmp_path / "out"
    refused_in_process("train_dp.py", hf_args(Path("HuggingFaceTB/SmolLM2-135M"), corpus, out)[:-2], out,
                       "--init-from HuggingFaceTB/SmolLM2-135M: no such folder here, and the Hugging Face Hub did "
                       "not give that model", capsys)


def test_a_tied_model_holds_one_matrix_counted_once(hf):
    """SmolLM2's embeddings are one parameter: counted once in the parameters, while the LM head's
    matmul still costs its FLOPs (MFU), tied or not."""
    import dataclasses

    from model import LlamaForPretraining
    model = imported(hf["smollm"])
    assert model.lm_head.weight is model.base_model.embed_tokens.weight
    untied = LlamaForPretraining(dataclasses.replace(model.config, tie_word_embeddings=False))
    assert model.num_parameters() == untied.num_parameters() - model.lm_head.weight.numel()
    assert model.flops_per_token(32) == untied.flops_per_token(32)


def test_tensor_parallelism_refuses_tied_embeddings_in_one_line(hf):
    from training import hf_import, tensor_parallel
    from training.errors import UsageError
    with pytest.raises(UsageError, match="ties its input and output embeddings"):
        tensor_parallel.check_model(hf_import.llama_config(hf["smollm"]), 2)
    tensor_parallel.check_model(hf_import.llama_config(hf["llama3"]), 2)  # untied: splits


def test_init_from_a_hugging_face_model_refuses_another_architecture_or_vocabulary(hf, corpus, tmp_path, capsys):
    """Its config.json is the architecture and its tokenizer the vocabulary: --model or a
    --vocab-size of another size asks for another model, refused rather than ignored."""
    out = tmp_path / "out"
    args = hf_args(hf["llama3"], corpus, out)[:-2]
    refused_in_process("train_dp.py", [*args, "--model", "tiny"], out, "brings its own architecture", capsys)
    refused_in_process("train_dp.py", [*args, "--vocab-size", "300"], out, "trained with 1,024 tokens", capsys)


def test_the_readme_recipe_streams_shards_into_an_imported_model_then_exports_it_tied(hf, corpus, tmp_path):
    """The README's recipe at test size: SmolLM2's shape continued on a folder of parquet shards by
    DDP on 2 ranks with --stream; the trained model exported loads in transformers tied, with our
    logits; and a run started from that run's folder is the same architecture again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import export_hf
    from training import weights
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = corpus.read_text().splitlines()
    for i in range(4):
        pq.write_table(pa.table({"text": lines[i::4]}), shards / f"part-{i}.parquet")
    run = tmp_path / "run"
    args = hf_args(hf["smollm"], shards, run, "--stream")
    train("train_ddp.py", args, nproc=2)
    assert tied(run)
    export_hf.export(str(run), str(tmp_path / "export"))
    theirs = published(tmp_path / "export")
    assert theirs.config.tie_word_embeddings and theirs.lm_head.weight is theirs.model.embed_tokens.weight
    ours, _ = weights.load_trained(str(run))
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids))
    again = tmp_path / "again"  # from the run's own folder: its config.json holds the imported architecture
    train("train_dp.py", hf_args(run, corpus, again, "--max-steps", "2"))
    assert json.loads((again / "config.json").read_text()) == {
        **json.loads((run / "config.json").read_text()), "trained_seq_len": 32}


def test_a_hub_id_resolves_once_to_a_commit_that_the_run_records(hf, corpus, tmp_path):
    """ORG/NAME is fetched through huggingface_hub's cache (here one laid out by hand, offline, as a
    download leaves it: refs/main naming a commit, the files under snapshots/<commit>): the run
    records the snapshot's folder, whose name is the commit, so its resumes and readers know which
    weights it started from even after the branch moves on."""
    import os
    import shutil
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(os.environ["HF_HOME"]) / "hub" / "models--someorg--tiny-llama3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(hf["llama3"], repo / "snapshots" / commit)
    run = tmp_path / "run"
    train("train_dp.py", hf_args(Path("someorg/tiny-llama3"), corpus, run, "--max-steps", "2"))
    recorded = torch.load(run / "checkpoint.pt", weights_only=True)["train_config"]["init_from"]
    assert recorded == str(repo / "snapshots" / commit)
    assert json.loads((run / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"


def test_an_imported_untied_model_trains_under_tensor_parallelism_as_one_process(hf, corpus, tmp_path):
    """Llama 3's shape (untied: train_tp.py splits it) at (dp 1, tp 2) ends with one process's
    weights and losses, within 20x the floor of these runs."""
    folder = hf["llama3"]
    one, reordered, tp = tmp_path / "dp", tmp_path / "dp_reversed", tmp_path / "tp"
    train("train_dp.py", hf_args(folder, corpus, one))
    train("train_dp.py", hf_args(folder, corpus, reordered), perturb="reverse-batches")
    train("train_tp.py", hf_args(folder, corpus, tp, "--tp", "2"), nproc=2)
    assert_same_model(one, tp, measure_floor(one, reordered))
