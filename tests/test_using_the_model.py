"""What a trained run is for: sampling text (generate.py), loading it in Hugging Face
transformers (export_hf.py), plotting its curves (plot_metrics.py), and the summary that
ends every run."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAST, REPO, run_in_process, script_in_process
from data import BOT, EOT, PAD, text_only
from model import LlamaConfig, LlamaForPretraining
from test_bad_inputs import swap_special_token_ids
from tools import export_hf, generate, plot_metrics
from training import config, metrics, weights
from training.errors import UsageError


@pytest.fixture(scope="module")
def trained(runs):
    return runs("dp", "train_dp.py")


def test_the_output_folder_loads_as_its_documentation_shows(trained):
    """docs/output-folder.md's snippet, run on a real output folder: config.json and model.pt
    make the model without this project's loaders, and it gives logits."""
    doc = (REPO / "docs" / "output-folder.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "out/config.json" in block)
    scope = {}
    exec(snippet.replace('"out/', f'"{trained}/'), scope)
    assert scope["logits"].shape == (1, 3, scope["config"].vocab_size)


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForPretraining(config).eval()


def greedy_without_cache(model, prompt, n):
    """The obvious way to decode: a full forward over the whole sequence for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


# ---- generation -------------------------------------------------------------------------

def test_without_a_stop_token_generate_returns_max_new_tokens_ids_from_the_vocabulary(small_model):
    new = generate.generate(small_model, [1, 5, 7], max_new_tokens=12, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    assert len(new) == 12 and all(isinstance(t, int) and 0 <= t < 101 for t in new)


def test_greedy_decoding_with_the_kv_cache_equals_decoding_without_it(small_model):
    prompt = [1, 17, 42, 9]
    expected = greedy_without_cache(small_model, prompt, 30)
    assert generate.generate(small_model, prompt, 30, temperature=0) == expected
    assert generate.generate(small_model, prompt, 30, temperature=0) == expected  # deterministic
    # top-k 1 keeps only the likeliest token: sampling becomes greedy
    assert generate.generate(small_model, prompt, 30, temperature=1.0, top_k=1,
                             generator=torch.Generator().manual_seed(3)) == expected


def test_sampling_repeats_with_the_same_seed_and_varies_with_another(small_model):
    def sample(seed):
        return generate.generate(small_model, [1, 2, 3], 40, temperature=1.0,
                                 generator=torch.Generator().manual_seed(seed))
    assert sample(0) == sample(0)
    assert sample(0) != sample(1)  # 40 draws from ~100 near-uniform choices


def test_generation_ends_at_the_stop_token_which_is_not_returned(small_model):
    prompt = [1, 17, 42, 9]
    expected = greedy_without_cache(small_model, prompt, 10)
    stop = expected[4]
    assert generate.generate(small_model, prompt, 10, stop_id=stop) == expected[:expected.index(stop)]


def expected_text(model, tokenizer, prompt_text, n):
    """What greedy sampling must print: the prompt, then the argmax of the model's logits at each
    step (a full forward each time, no KV cache), up to [EOT], without special tokens."""
    prompt = [tokenizer.token_to_id(BOT)] + tokenizer.encode(prompt_text, add_special_tokens=False).ids
    new = greedy_without_cache(model, prompt, n)
    eot = tokenizer.token_to_id(EOT)
    new = new[:new.index(eot)] if eot in new else new
    return tokenizer.decode(prompt + new, skip_special_tokens=True) + "\n"


def test_generate_script_prints_the_greedy_continuation_and_repeats_a_seeded_sample(trained, capsys):
    model, tokenizer = weights.load_trained(trained)
    args = [str(trained), "--prompt", "the model", "--max-new-tokens", "24"]
    assert script_in_process("tools/generate.py", [*args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert greedy == expected_text(model, tokenizer, "the model", 24)
    assert len(greedy) > len("the model\n") and not any(token in greedy for token in (PAD, BOT, EOT))
    generate.main([*args, "--seed", "5"])
    sampled = capsys.readouterr().out
    generate.main([*args, "--seed", "5"])
    assert capsys.readouterr().out == sampled != greedy


def test_generate_stays_within_the_trained_context_unless_asked_and_then_says_so(trained, capsys, monkeypatch):
    """Trained at --seq-len 32 (RoPE reaches 1,024): with no --max-new-tokens the prompt and
    its continuation fill at most 32 positions; asked for more, it generates them after one
    warning line."""
    model, tokenizer = weights.load_trained(trained)
    prompt = 1 + len(tokenizer.encode("the model", add_special_tokens=False).ids)  # [BOT] first
    lengths, real = [], generate.generate
    monkeypatch.setattr(generate, "generate", lambda m, ids, n, *a, **k: lengths.append(len(ids) + n) or
                        real(m, ids, n, *a, **k))
    generate.main([str(trained), "--prompt", "the model", "--temperature", "0"])
    printed = capsys.readouterr()
    assert lengths == [32] and printed.err == "" and printed.out == expected_text(model, tokenizer, "the model",
                                                                                   32 - prompt)
    generate.main([str(trained), "--prompt", "the model", "--temperature", "0", "--max-new-tokens", "40"])
    printed = capsys.readouterr()
    assert lengths[1:] == [prompt + 40] and printed.out == expected_text(model, tokenizer, "the model", 40)
    assert printed.err == (f"warning: the model was trained on sequences of 32 tokens: the prompt ({prompt} tokens) "
                           "plus 40 new ones go past what it has seen\n")


def test_an_unfinished_run_samples_from_its_newest_checkpoint_and_says_so(trained, tmp_path, capsys):
    out = tmp_path / "unfinished"
    shutil.copytree(trained, out)
    (out / "model.pt").unlink()
    generate.main([str(out), "--max-new-tokens", "4", "--temperature", "0", "--prompt", "the"])
    printed = capsys.readouterr()
    assert printed.err.strip() == (f"warning: no model.pt in {out} (the run has not finished): "
                                   "using checkpoint.pt, step 8")
    model, tokenizer = weights.load_trained(trained)  # step 8's weights are the final ones
    assert printed.out == expected_text(model, tokenizer, "the", 4)


@pytest.mark.parametrize("argv, message", [
    (["{out}", "--temperature", "-1"], "--temperature must be a non-negative number, got -1.0"),
    (["{out}", "--temperature", "nan"], "--temperature must be a non-negative number, got nan"),
    (["{out}", "--top-k", "0"], "--top-k must be at least 1, got 0"),
    (["{out}", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["{out}", "--max-new-tokens", "1024"], "plus --max-new-tokens 1024 exceed the model's 1024 positions"),
    (["{out}", "--prompt", "the " * 1100], "tokens) and one new token exceed the model's 1024 positions"),  # no flag cited
    (["{missing}"], "is not the output folder of a training run (no config.json)"),
    (["{no_weights}"], "holds no model.pt and no checkpoint: nothing trained yet"),
    (["{out}", "--seed", str(2**63)], "--seed must be within 0 and 2^63 - 1, got 9223372036854775808"),
    (["{out}", "--seed", "-1"], "--seed must be within 0 and 2^63 - 1, got -1"),
    (["{out}", "--temperature", "1e-45"], "--temperature must be 0 (greedy) or at least 0.001, got 1e-45"),
    (["{out}", "--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text"),  # the byte 0xe9, as argv holds it
    (["{bad_config}"], "config.json: vocab_size must be a positive integer below 2**31, got -1"),
])
def test_generate_refuses_bad_input(trained, tmp_path, argv, message):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(trained / "config.json", no_weights)
    bad_config = tmp_path / "bad_config"
    shutil.copytree(trained, bad_config)
    (bad_config / "config.json").write_text(json.dumps({**json.loads((trained / "config.json").read_text()),
                                                        "vocab_size": -1}))
    fill = {"{out}": str(trained), "{missing}": str(tmp_path / "missing"), "{no_weights}": str(no_weights),
            "{bad_config}": str(bad_config)}
    with pytest.raises(UsageError, match=re.escape(message)):
        generate.main([fill.get(a, a) for a in argv])


def _config(out, **changes):
    config = out / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def _weights(out, change):
    state = torch.load(out / "model.pt", weights_only=True)
    change(state)
    torch.save(state, out / "model.pt")


def _fifo(path):
    import os
    path.unlink()
    os.mkfifo(path)


def _another_tokenizer(out):
    import data
    import datasets
    texts = datasets.Dataset.from_dict({"text": [f"document {i}: the quick brown fox, {i * 7} lazy dogs" for i in range(500)]})
    data.train_tokenizer(texts, 400).save(str(out / "tokenizer.json"))


@pytest.mark.parametrize("damage, message", [
    (lambda out: _config(out, rope_theta=0), "rope_theta must be a positive number, got 0"),
    (lambda out: _config(out, rms_norm_eps="x"), "rms_norm_eps must be a positive number, got x"),
    (lambda out: _config(out, max_position_embeddings=10**12), "max_position_embeddings must be a positive integer "
                                                                "below 2**31, got 1000000000000"),
    (lambda out: _config(out, vocab_size=10**400), "vocab_size must be a positive integer below 2**31, got 1000000"),
    (lambda out: (out / "config.json").write_text("[" * 100_000), "cannot read"),  # nested past the parser
    (_another_tokenizer, "has 400 tokens, and the model 300 embedding rows (config.json): the tokenizer of another run or model?"),
    (lambda out: swap_special_token_ids(out / "tokenizer.json"), "is not the tokenizer its run was trained with"),
    (lambda out: _weights(out, lambda s: s.update({"lm_head.weight": s["lm_head.weight"].long()})),
     "are not finite (lm_head.weight holds NaN, inf or integers)"),
    (lambda out: _weights(out, lambda s: s.update({"lm_head.weight": s["lm_head.weight"].to_sparse()})),
     "are not finite (lm_head.weight holds NaN, inf or integers)"),
    (lambda out: _fifo(out / "model.pt"), "model.pt is not a regular file"),  # not passed over for a checkpoint
], ids=["rope-theta-0", "eps-text", "positions-10^12", "vocab-10^400", "nested", "tokenizer-400", "tokenizer-edited", "integers",
        "sparse", "model-fifo"])
def test_generate_and_export_refuse_a_damaged_output_folder_in_one_line(trained, tmp_path, damage, message):
    """Every file of an output folder may be damaged or replaced: what generate.py and
    export_hf.py read is checked, in one line, never a traceback, an allocation of terabytes,
    a silent cast of integer weights, nor text sampled through another run's tokenizer."""
    out = shutil.copytree(trained, tmp_path / "run")
    damage(out)
    with pytest.raises(UsageError, match=re.escape(message)):
        generate.main([str(out), "--max-new-tokens", "2"])
    with pytest.raises(UsageError, match=re.escape(message)):
        export_hf.export(str(out), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_a_folder_from_before_the_tokenizer_fingerprint_is_used_unchecked(trained, tmp_path):
    """config.json without tokenizer_fingerprint (written by an earlier version): generate.py and
    export_hf.py use it as before."""
    out = shutil.copytree(trained, tmp_path / "run")
    fields = json.loads((out / "config.json").read_text())
    del fields["tokenizer_fingerprint"]
    (out / "config.json").write_text(json.dumps(fields))
    generate.main([str(out), "--max-new-tokens", "2"])
    export_hf.export(str(out), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_an_export_never_deletes_what_it_did_not_write(trained, tmp_path):
    """The export is written as .NAME.partial and renamed: one left by an interrupted export is
    replaced. Anything else under that name is the user's: one line, and it stays."""
    mine = tmp_path / ".hf.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    with pytest.raises(UsageError, match=re.escape(f"{mine} is in the way, and is not an unfinished export")):
        export_hf.export(str(trained), str(tmp_path / "hf"))
    assert (mine / "notes.txt").read_text() == "the user's own file"
    (mine / "notes.txt").unlink()
    (mine / "config.json").write_text("{}")  # what an interrupted export leaves
    export_hf.export(str(trained), str(tmp_path / "hf"))
    assert not mine.exists() and (tmp_path / "hf" / "model.safetensors").is_file()


def config_asking_for(out: Path, **changes):
    config = out / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.parametrize("weights", ["model.pt", "checkpoint.pt"])
def test_a_config_that_does_not_fit_the_weights_is_refused_before_the_model_is_allocated(trained, tmp_path, weights):
    """config.json asking for a vocabulary of 2^30 (1 TiB of embedding) next to the weights of
    a 300-token model: the shapes are compared on the meta device, and the line says which
    weight differs, instead of an allocation that fails (or, at 3 million tokens, one of 6 GB
    that succeeds, only to be refused later)."""
    out = shutil.copytree(trained, tmp_path / "run")
    if weights == "checkpoint.pt":  # an unfinished run: its newest checkpoint
        (out / "model.pt").unlink()
    config_asking_for(out, vocab_size=2**30)
    with pytest.raises(UsageError, match=re.escape(
            f"the weights in {out} do not fit its config.json: base_model.embed_tokens.weight is (300, 64) in "
            "the weights, (1,073,741,824, 64) by config.json")):
        generate.main([str(out)])


def test_a_prompt_that_spells_out_a_special_token_is_text(trained, capsys):
    """"[EOT]" typed in a prompt is not the end of a document: it is encoded, and printed, as text."""
    generate.main([str(trained), "--prompt", "a [EOT] b [BOT]", "--temperature", "0", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("a [EOT] b [BOT]")


def test_bad_input_to_the_tools_is_one_line_on_stderr(tmp_path, capsys):
    for script, args in [("tools/generate.py", [str(tmp_path)]), ("tools/export_hf.py", [str(tmp_path), str(tmp_path / "hf")]),
                         ("tools/plot_metrics.py", [str(tmp_path), "-o", str(tmp_path / "p.png")])]:
        assert script_in_process(script, args) == 2, script
        printed = capsys.readouterr()
        assert printed.out == "" and len(printed.err.splitlines()) == 1 and printed.err.startswith("error: "), printed
    assert list(tmp_path.iterdir()) == []  # nothing written


# ---- Hugging Face export ------------------------------------------------------------------

def test_export_writes_the_files_transformers_reads(trained, tmp_path):
    hf = tmp_path / "hf"
    export_hf.main([str(trained), str(hf)])
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    from safetensors.torch import load_file
    weights = load_file(hf / "model.safetensors")
    ours = torch.load(trained / "model.pt", map_location="cpu", weights_only=True)
    assert weights.keys() == {k.replace("base_model.", "model.") for k in ours}
    assert all(torch.equal(weights[k.replace("base_model.", "model.")], v) for k, v in ours.items())
    assert not list(tmp_path.glob(".*partial"))  # written beside, then renamed into place


def test_a_run_records_the_sequence_length_it_trained_at_and_the_export_carries_it(corpus, tmp_path):
    """The tiny preset's RoPE reaches 1,024 positions; a run at --seq-len 64 has seen 64. Its
    config.json says so, and the export tells transformers 64 (max_position_embeddings, and
    the tokenizer's model_max_length), not 1,024."""
    out, hf = tmp_path / "run", tmp_path / "hf"
    run_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--seq-len", "64", "--max-steps", "2",
                                   "--out-dir", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["trained_seq_len"] == 64 and config["max_position_embeddings"] == 1024
    export_hf.main([str(out), str(hf)])
    assert json.loads((hf / "config.json").read_text())["max_position_embeddings"] == 64
    assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == 64


def test_export_into_a_path_under_a_file_is_one_line(trained, tmp_path):
    (tmp_path / "a_file").write_text("precious")
    with pytest.raises(UsageError, match=f"the export folder {tmp_path}/a_file/hf: {tmp_path}/a_file is a file"):
        export_hf.main([str(trained), str(tmp_path / "a_file" / "hf")])
    assert (tmp_path / "a_file").read_text() == "precious"


def test_export_never_overwrites_a_folder_that_holds_files(trained, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists: choose a new folder"):
        export_hf.main([str(trained), str(hf)])
    assert [p.name for p in hf.iterdir()] == ["notes.txt"] and (hf / "notes.txt").read_text() == "mine"


def test_transformers_loads_the_export_with_our_logits_tokens_and_greedy_text(trained, tmp_path):
    transformers = pytest.importorskip("transformers")  # in requirements-dev.txt: CI runs this
    hf = tmp_path / "hf"
    export_hf.main([str(trained), str(hf)])
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert isinstance(hf_tokenizer, transformers.PreTrainedTokenizerFast)
    ours, tokenizer = weights.load_trained(trained)

    ids = torch.randint(0, ours.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    print(f"max |logit difference| ours vs transformers: {diff:.3g}")
    assert diff < 1e-4

    # the tokenizer frames text as training did: [BOT] first, then our ids
    text = "the model reads tokens"
    prompt = hf_tokenizer(text)["input_ids"]
    assert prompt == [tokenizer.token_to_id(BOT)] + tokenizer.encode(text, add_special_tokens=False).ids
    # and "[EOT]" written in a text is text, as in training (split_special_tokens), not the token
    spelled = "a [EOT] b"
    assert hf_tokenizer(spelled)["input_ids"] == [tokenizer.token_to_id(BOT)] + text_only(tokenizer).encode(
        spelled, add_special_tokens=False).ids
    assert tokenizer.token_to_id(EOT) not in hf_tokenizer(spelled)["input_ids"]
    # greedy generation in transformers (stopping at [EOT] from generation_config.json) = ours
    new = generate.generate(ours, prompt, 20, temperature=0, stop_id=tokenizer.token_to_id(EOT))
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    assert out[0, len(prompt):].tolist() in (new, new + [tokenizer.token_to_id(EOT)])
    assert hf_tokenizer.decode(out[0], skip_special_tokens=True) == tokenizer.decode(
        prompt + new, skip_special_tokens=True)


# ---- loss plots -----------------------------------------------------------------------------

def test_plot_overlays_several_runs_into_one_png(trained, runs, tmp_path, monkeypatch):
    """Every run's train and val losses, each as logged, on one figure (seen before it closes)."""
    pytest.importorskip("matplotlib")  # optional for users; in requirements-dev.txt: CI runs this
    import matplotlib.pyplot as plt
    figures, real_close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), real_close(fig)))
    other = runs("dp_accum2", "train_dp.py", ["--grad-accum", "2"])
    png = tmp_path / "curves.png"
    plot_metrics.main([str(trained), str(other), "-o", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    [figure] = [f for f in figures if isinstance(f, plt.Figure)]
    [loss_axes, _] = figure.axes
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in loss_axes.get_lines()}
    expected = {}
    for run in (trained, other):
        rows = plot_metrics.read_metrics(run)
        expected[f"{run.name} train"] = plot_metrics.series(rows, "loss")
        expected[f"{run.name} val"] = plot_metrics.series(rows, "val_loss")
    assert drawn == {label: (list(x), list(y)) for label, (x, y) in expected.items()}
    assert drawn["dp train"][1] != drawn["dp_accum2 train"][1]  # two runs, not one drawn twice


def test_plot_draws_every_logged_point(trained):
    rows = plot_metrics.read_metrics(trained)
    assert plot_metrics.series(rows, "loss")[0] == [2, 4, 6, 8]  # --log-every 2
    assert plot_metrics.series(rows, "val_loss")[0] == [4, 8]  # --eval-every 4
    assert len(plot_metrics.series(rows, "tokens_per_s_nonpad")[1]) == 4


def test_a_run_that_has_logged_only_its_facts_has_nothing_to_plot_yet(trained, tmp_path):
    """A new run's first row of metrics.jsonl says what an epoch trains on; it is no step."""
    facts = (trained / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(facts)["step"] == 0 and "loss" not in facts
    (tmp_path / "metrics.jsonl").write_text(facts + "\n")
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'metrics.jsonl'} holds no logged step yet")):
        plot_metrics.main([str(tmp_path), "-o", str(tmp_path / "p.png")])


def test_plot_names_the_file_it_writes_and_refuses_what_it_cannot(trained, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot_metrics.main([str(trained), "-o", str(tmp_path / "curves")])  # no suffix: PNG, and said so
    assert capsys.readouterr().out == f"wrote {tmp_path / 'curves.png'}\n"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UsageError, match=r"--output .*x\.pt: matplotlib cannot write \.pt files \(it writes .*\.png"):
        plot_metrics.main([str(trained), "-o", str(tmp_path / "x.pt")])
    no_step = tmp_path / "no_step"
    no_step.mkdir()
    (no_step / "metrics.jsonl").write_text('{"loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl, line 1: not a row with a step"):
        plot_metrics.main([str(no_step), "-o", str(tmp_path / "p.png")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "no_step"]


def test_plot_without_matplotlib_says_how_to_get_it(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert script_in_process("tools/plot_metrics.py", [str(trained), "-o", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == "error: plot_metrics.py needs matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "p.png").exists()


# ---- the summary at the end of a run --------------------------------------------------------

def test_a_finished_run_ends_with_a_summary_of_steps_tokens_losses_and_files(runs):
    out = runs("dp", "train_dp.py")
    printed = runs.output["dp"]
    summary = printed[printed.index("done after step 8 of 8"):].splitlines()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss, val_loss = rows[-2]["loss"], rows[-1]["val_loss"]  # step 8: train row, then eval row
    tokens = re.fullmatch(rf"done after step 8 of 8: ([\d,]+) tokens \(2,048 positions with padding\) in "
                          rf"\d+:\d\d:\d\d \| train loss {loss:.4f} \| val loss {val_loss:.4f}", summary[0])
    assert tokens, summary[0]  # 8 steps x 8 x 32 positions, and the real tokens among them: each logged
    # interval (2 steps, 512 positions) trained its share of real ones, nonpad over all tokens/s
    real = sum(512 * row["tokens_per_s_nonpad"] / row["tokens_per_s"] for row in rows if "loss" in row)
    assert abs(int(tokens.group(1).replace(",", "")) - real) < 1 and real < 2_048
    assert summary[1] == f"weights in {out}/model.pt, with tokenizer.json, config.json and metrics.jsonl beside them"
    assert summary[2:] == [f"  sample:   python tools/generate.py {out} --prompt 'The '",
                           f"  export:   python tools/export_hf.py {out} {out}-hf",
                           f"  plot:     python tools/plot_metrics.py {out} -o {out}/metrics.png"]


def test_the_summary_counts_only_the_steps_of_this_session():
    cfg = config.TrainConfig(out_dir="out", batch_size=64, seq_len=512)
    text = metrics.summary(cfg, step=3000, total_steps=10000, first_step=1000, trained=49_000_000, seconds=3725.4,
                           latest={"loss": (3000, 3.25)}, preempted=True, checkpoint=Path("out/checkpoint.pt"))
    assert text.splitlines() == [
        "stopped by a signal after step 3000 of 10000: 49,000,000 tokens (65,536,000 positions with padding) in "
        "1:02:05 | train loss 3.2500",
        "checkpoint saved in out/checkpoint.pt; continue with --resume"]


def test_a_run_stopped_between_two_logs_names_the_step_of_each_loss_it_reports():
    """A signal after step 2,047: the train loss was last logged at step 2,040 and the val loss
    at 2,000. Printed bare, they would read as the stopped model's."""
    cfg = config.TrainConfig(out_dir="out", batch_size=64, seq_len=512)
    log = metrics.MetricsLog(cfg, enabled=False)
    for row in [{"step": 2000, "loss": 3.5}, {"step": 2000, "val_loss": 3.61}, {"step": 2040, "loss": 3.25}]:
        log.write(row)
    text = metrics.summary(cfg, step=2047, total_steps=10000, first_step=1000, trained=9_000_000, seconds=600,
                           latest=log.latest, preempted=True, checkpoint=Path("out/checkpoint.pt"))
    assert text.splitlines()[0].endswith("in 0:10:00 | train loss 3.2500 at step 2040 | val loss 3.6100 at step 2000")


def test_the_summary_quotes_paths_so_its_commands_paste_into_a_shell():
    import shlex
    cfg = config.TrainConfig(out_dir="my runs/ü 1", batch_size=8, seq_len=32, dataset="c.txt")
    lines = metrics.summary(cfg, step=8, total_steps=8, first_step=0, trained=200, seconds=3.0,
                            latest={"loss": (8, 1.0), "val_loss": (8, 1.0)}, preempted=False,
                            checkpoint=Path("my runs/ü 1/checkpoint.pt")).splitlines()
    assert shlex.split(lines[2].split(":", 1)[1]) == ["python", "tools/generate.py", "my runs/ü 1", "--prompt", "The "]
    assert shlex.split(lines[3].split(":", 1)[1]) == ["python", "tools/export_hf.py", "my runs/ü 1", "my runs/ü 1-hf"]
    assert shlex.split(lines[4].split(":", 1)[1]) == ["python", "tools/plot_metrics.py", "my runs/ü 1", "-o",
                                                      "my runs/ü 1/metrics.png"]


def test_a_warmup_as_long_as_the_run_is_warned_about(capsys):
    cfg = config.TrainConfig(warmup_steps=100, max_steps=50, epochs=1)
    assert config.total_steps(cfg, steps_per_epoch=80) == 50
    assert capsys.readouterr().err == ("warning: --warmup-steps 100 is not shorter than the run (50 steps): the "
                                       "learning rate is still warming up when the run ends, and never decays\n")
    cfg = config.TrainConfig(warmup_steps=10, max_steps=50, epochs=1)
    assert config.total_steps(cfg, steps_per_epoch=80) == 50 and capsys.readouterr().err == ""


def test_max_steps_beyond_the_epochs_is_warned_about_naming_epochs(capsys):
    """--max-steps 4 where --epochs 3 take 3 steps: the run trains 3 and says which flag ended it."""
    cfg = config.TrainConfig(warmup_steps=1, max_steps=4, epochs=3)
    assert config.total_steps(cfg, steps_per_epoch=1) == 3
    assert capsys.readouterr().err == ("warning: --max-steps 4 is more than --epochs 3 take (3 steps, 1 an epoch): "
                                       "the run trains 3 steps, its learning rate schedule 3 steps long. Raise "
                                       "--epochs to train 4\n")
    cfg = config.TrainConfig(warmup_steps=1, max_steps=3, epochs=3)
    assert config.total_steps(cfg, steps_per_epoch=1) == 3 and capsys.readouterr().err == ""
    cfg = config.TrainConfig(model="debug", warmup_steps=5, max_steps=50, epochs=3)  # the preset's, not given
    assert config.total_steps(cfg, steps_per_epoch=10) == 30
    assert capsys.readouterr().err.startswith("warning: --max-steps 50 (the debug preset's) is more than --epochs 3 "
                                              "take (30 steps, 10 an epoch)")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_give_one_line_not_a_traceback_or_empty_text(trained, tmp_path, capsys, bad):
    """A diverged or damaged model.pt: generate.py and export_hf.py refuse it in one line."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(trained / name, out / name)
    state = torch.load(trained / "model.pt", weights_only=True)
    state["base_model.norm.weight"][0] = bad
    torch.save(state, out / "model.pt")
    for script, args in [("tools/generate.py", [str(out), "--temperature", "0"]),
                         ("tools/export_hf.py", [str(out), str(tmp_path / "hf")])]:
        assert script_in_process(script, args) == 2, script
        printed = capsys.readouterr()
        assert printed.err == (f"error: the weights in {out} are not finite (base_model.norm.weight holds NaN, inf "
                               "or integers): nothing to sample or export from them\n"), printed
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: __import__("os").mkfifo(p)], ids=["folder", "fifo"])
def test_a_plot_that_cannot_be_written_is_one_line(trained, tmp_path, capsys, make):
    """A folder where the image would go, or a FIFO (whose write would block forever)."""
    pytest.importorskip("matplotlib")
    make(tmp_path / "taken.svg")
    assert script_in_process("tools/plot_metrics.py", [str(trained), "-o", str(tmp_path / "taken.svg")]) == 2
    printed = capsys.readouterr()
    assert printed.err == f"error: --output {tmp_path / 'taken.svg'} exists and is not a file: choose another name\n"


def test_a_metrics_row_holding_what_no_run_logs_is_one_line(trained, tmp_path, capsys):
    """Every value a run logs is a number: a row holding {"a": 1}, a list or an integer past
    what a float holds is damage, named by its line (plot_metrics.py drew a traceback)."""
    pytest.importorskip("matplotlib")
    out = shutil.copytree(trained, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "loss": {"a": 1}}) + "\n" + json.dumps({"step": 10, "loss": 1.0}) + "\n")
    assert script_in_process("tools/plot_metrics.py", [str(out), "-o", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {out / 'metrics.jsonl'}, line ")
    assert not (tmp_path / "p.png").exists()
