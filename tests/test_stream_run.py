"""A streamed run's data in its checkpoint (training/stream/run.py): the record of what it reads
round-trips and a resume names the first thing that changed, in one line, a hostile record
too; --stream and --sub-streams refused where they cannot work, and S chosen where not given;
every rank's sub-stream states gathered to rank 0 (gloo), saved, and shared out again at
another world size to train the same global batches."""

import argparse
import dataclasses
import json

import datasets
import pytest
import torch
import torch.distributed as dist

import data
from benchmarks import bench_stream, stream_state
from test_stream_holdout import SHARDS
from test_stream_loader import STREAMS, equal, expected_batches, feed_of, global_batch, local_rows, same_steps
from test_stream_rows import corpus, small_pieces, through_a_checkpoint, tokenizer  # noqa: F401
from test_stream_shards import write
from training import config
from training.errors import UsageError
from training.stream import run
from training.stream.holdout import validation_documents
from training.stream.loader import read_ahead
from training.stream.shards import find_shards


def one_line(call, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as error:
        call(*args, **kwargs)
    assert "\n" not in str(error.value), str(error.value)
    return str(error.value)


# ---------------------------------------------------------------------------------------
# The record, and a resume's check of it


@pytest.fixture
def folder(tmp_path):
    """test_stream_holdout's shards: parquet files of several row groups and JSON Lines files."""
    source = tmp_path / "corpus"
    for name, texts, row_group_size in SHARDS:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        write(source / name, texts, row_group_size)
    return source


def cfg_of(source, tmp_path, *flags):
    return config.parse_args(["--stream", "--dataset", str(source), "--out-dir", str(tmp_path / "out"),
                              "--seq-len", "8", "--sub-streams", "2", "--max-steps", "50", *flags])


def record_of(cfg, source, tokenizer, held_out_count: int = 4, streams: int = 2) -> dict:
    found = find_shards(str(source), cfg.text_column)
    _, held_out = validation_documents(str(source), found, cfg.text_column, held_out_count)
    return run.record(cfg, found, held_out, streams, tokenizer)


def test_the_record_is_json_and_a_checkpoints_and_a_resume_of_the_same_run_passes(folder, tmp_path, tokenizer):
    cfg = cfg_of(folder, tmp_path, "--pack")
    recorded = record_of(cfg, folder, tokenizer)
    assert list(recorded) == list(run.FIELDS)
    assert [shard["name"] for shard in recorded["shards"]] == [name for name, _, _ in SHARDS]
    assert recorded["held_out"] == {"count": 4, "piece": 1, "row": 2}
    assert (recorded["sub_streams"], recorded["seq_len"], recorded["pack"], recorded["seed"]) == (2, 8, True, 1337)
    assert json.loads(json.dumps(recorded)) == recorded
    for saved in (json.loads(json.dumps(recorded)), through_a_checkpoint({"record": recorded})["record"]):
        run.check_resume(saved, record_of(cfg, folder, tokenizer))  # found again, from the files
    run.check_resume(None, None)  # a run without --stream, resumed without it


@pytest.fixture
def another_tokenizer():
    return data.train_tokenizer(datasets.Dataset.from_dict({"text": ["other words entirely"] * 20}), vocab_size=270)


CHANGES = {
    "a shard appended": "the checkpoint was trained on other shards: shard c/c.jsonl was added. Resume with the "
                        "shards it read",
    "a shard's digest": "the checkpoint was trained on other shards: shard b.jsonl changed: its first 64 KiB differ",
    "the text column": "the checkpoint read the column 'text' of its shards, and this run reads 'body': resume with "
                       "--text-column text",
    "the held-out count": "this run held out 4 validation documents, not 5: resume with --val-docs 4",
    "S": "the checkpoint dealt its shards into 2 sub-streams, and this run into 4: resume with --sub-streams 2, or "
         "leave it out",
    "seq_len": "the checkpoint read its rows with --seq-len 8, and this run asks for 16: resume with --seq-len 8",
    "seed": "the checkpoint read its rows with --seed 1337, and this run asks for 7: resume with --seed 1337",
    "pack": "the checkpoint was trained without --pack (its rows hold one window each): resume without --pack",
    "the tokenizer": "the checkpoint read its rows with another tokenizer (its ids stand for other tokens)",
}


def changed_record(change: str, cfg, folder, tokenizer, another_tokenizer) -> dict:
    """This run's record, the shards or the flags changed as `change` says."""
    if change == "a shard appended":
        write(folder / "c" / "c.jsonl", ["a document more"])
    if change == "a shard's digest":
        (folder / "b.jsonl").write_text((folder / "b.jsonl").read_text().replace("d6", "e6"))  # its size as it was
    flags = {"seq_len": {"seq_len": 16}, "seed": {"seed": 7}, "pack": {"pack": True}}.get(change, {})
    now = record_of(dataclasses.replace(cfg, **flags), folder, another_tokenizer if change == "the tokenizer" else
                    tokenizer, 5 if change == "the held-out count" else 4, 4 if change == "S" else 2)
    return {**now, "text_column": "body"} if change == "the text column" else now  # (the shards have no such column)


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_names_the_change_in_one_line(folder, tmp_path, tokenizer, another_tokenizer, change):
    cfg = cfg_of(folder, tmp_path)
    recorded = through_a_checkpoint({"record": record_of(cfg, folder, tokenizer)})["record"]
    run.check_resume(recorded, record_of(cfg, folder, tokenizer))  # nothing changed yet
    now = changed_record(change, cfg, folder, tokenizer, another_tokenizer)
    assert CHANGES[change] in one_line(run.check_resume, recorded, now, "the checkpoint")


@pytest.mark.parametrize("packed", [False, True], ids=["pack-added", "pack-dropped"])
def test_a_resume_that_adds_or_drops_pack_is_one_line_either_way(folder, tmp_path, tokenizer, packed):
    """--pack decides what a row holds (several windows, or one) and what every sub-stream's
    state holds (a packer's open rows, or none): a resume with --pack of a run without it, and
    one without it of a run with it, are each this record's line, not a later one of the
    states'."""
    flags = ["--pack"] if packed else []
    recorded = through_a_checkpoint({"record": record_of(cfg_of(folder, tmp_path, *flags), folder, tokenizer)})
    now = record_of(cfg_of(folder, tmp_path, *([] if packed else ["--pack"])), folder, tokenizer)
    said, rows = ("with", "several windows") if packed else ("without", "one window")
    assert one_line(run.check_resume, recorded["record"], now) == (
        f"the checkpoint was trained {said} --pack (its rows hold {rows} each): resume {said} --pack")
    run.check_resume(recorded["record"], record_of(cfg_of(folder, tmp_path, *flags), folder, tokenizer))


def test_a_resume_with_or_without_stream_unlike_its_run_is_one_line(folder, tmp_path, tokenizer):
    recorded = record_of(cfg_of(folder, tmp_path), folder, tokenizer)
    assert "checkpoint-00000004.pt was trained with --stream: resume with it" in one_line(
        run.check_resume, recorded, None, "checkpoint-00000004.pt")
    assert "the checkpoint was trained without --stream: resume without it" in one_line(
        run.check_resume, None, recorded)


def test_a_hostile_record_is_one_line_naming_what_is_wrong(folder, tmp_path, tokenizer):
    good = record_of(cfg_of(folder, tmp_path), folder, tokenizer)
    fields = ", ".join(run.FIELDS)
    cases = [
        ([good], f"ckpt.pt's stream record holds list, not {fields}: it is damaged"),
        ({k: v for k, v in good.items() if k != "seed"}, "ckpt.pt's stream record holds ['held_out', 'hub', 'pack'"),
        ({**good, "extra": 1}, "holds ['extra', 'held_out'"),
        ({**good, 3: 1}, "holds ['3', 'held_out'"),
        ({**good, "sub_streams": "2"}, "ckpt.pt's stream record: sub_streams is '2', not a whole number of at least 1"),
        ({**good, "sub_streams": True}, "sub_streams is True, not a whole number"),
        ({**good, "sub_streams": 0}, "sub_streams is 0, not a whole number of at least 1"),
        ({**good, "seq_len": -8}, "seq_len is -8, not a whole number of at least 1"),
        ({**good, "seed": 2**63}, "seed is 9223372036854775808, not a whole number from 0 to 2**63 - 1"),
        ({**good, "pack": 1}, "pack is 1, not true or false"),
        ({**good, "tokenizer": "0" * 31}, "tokenizer is '0000000000000000000000000000000', not a tokenizer's"),
        ({**good, "tokenizer": torch.zeros(2, 3)}, "tokenizer is tensor([[0., 0., 0.], [0., 0., 0.]]), not a"),
        ({**good, "text_column": ""}, "text_column is '', not a column's name"),
        ({**good, "shards": {"a": 1}}, "shards is {'a': 1}, not a list of shards"),
        ({**good, "shards": [{**good["shards"][0], "size": -1}]}, "its size is not a count of bytes"),
        ({**good, "shards": good["shards"] * 2}, "the shard record lists a.parquet twice"),
        ({**good, "held_out": [4, 1, 2]}, "held_out is [4, 1, 2], not a held-out set"),
        ({**good, "held_out": {"count": 0, "piece": 1, "row": 2}}, "held-out record {'count': 0, 'piece': 1, 'row': "
                                                                   "2}: expected count, piece, row"),
    ]
    for bad, said in cases:
        assert said in one_line(run.check_resume, bad, good, "ckpt.pt"), said


# ---------------------------------------------------------------------------------------
# The flags, and S


def test_the_flags_parse_and_are_refused_where_they_cannot_work(folder, tmp_path):
    (tmp_path / "notes.txt").write_text("a document\n")
    out = ["--out-dir", str(tmp_path / "out")]
    plain = config.parse_args(out)
    assert (plain.stream, plain.sub_streams) == (False, None)
    steps = ["--max-steps", "50"]  # a stream has no length: --model's preset gives it none
    cfg = config.parse_args(["--stream", "--dataset", str(folder), "--sub-streams", "4", *steps, *out])
    assert (cfg.stream, cfg.sub_streams, cfg.batch_size, cfg.max_steps) == (True, 4, 16, 50)
    assert config.parse_args(["--stream", "--dataset", str(folder / "b.jsonl"), *steps, *out]).sub_streams is None
    refusals = [
        (["--dataset", str(folder), "--sub-streams", "4"], "--sub-streams sets how many sub-streams --stream deals "
                                                            "the shards into: add --stream, or leave it out"),
        (["--stream", "--dataset", str(folder), "--sub-streams", "3"], "--sub-streams 3 does not divide --batch-size "
                                                                       "16: each step takes as many rows from every"),
        (["--stream", "--dataset", str(folder), "--sub-streams", "32"], "--sub-streams 32 does not divide"),
        (["--stream", "--dataset", str(folder), "--sub-streams", "0"], "--sub-streams must be at least 1, got 0"),
        (["--stream"], "--stream reads a folder or file of shards (.parquet/.jsonl/.jsonl.gz/.jsonl.zst) or a Hub "
                       "dataset's, and the embedded corpus (stdlib) is none"),
        (["--stream", "--dataset", str(tmp_path / "notes.txt")], "--stream reads .parquet/.jsonl/.jsonl.gz/.jsonl.zst "
                                                                 "shards, not"),
        (["--stream", "--dataset", str(tmp_path / "missing")], "dataset file or folder not found"),
        # the stream's len(), --max-steps x --batch-size rows, must fit in 2**63 - 1 (an OverflowError otherwise)
        (["--stream", "--dataset", str(folder), "--max-steps", str(10**12), "--batch-size", str(10**7)],
         "--max-steps 1,000,000,000,000 x --batch-size 10,000,000 sequences are more than a run can count "
         "(9,223,372,036,854,775,807): lower one of them"),
    ]
    for flags, said in refusals:
        given = [] if "--max-steps" in flags else steps
        assert said in one_line(config.parse_args, [*flags, *given, *out]), said
    for model in ("debug", "tiny"):  # a preset's 50 or 250 steps were a stream's length, said nowhere
        assert "--stream needs --max-steps" in one_line(config.parse_args, ["--stream", "--dataset", str(folder),
                                                                            "--model", model, *out])


@dataclasses.dataclass
class Flags:
    batch_size: int = 16
    sub_streams: int | None = None
    tp: int = 1  # train_tp.py's --tp: the refusals count data-parallel groups under it


def test_s_is_the_flags_the_runs_or_eight_fitted_to_the_batch_the_ranks_and_the_pieces():
    pieces = [100] * 34
    assert run.sub_streams(Flags(), 1, pieces) == run.DEFAULT_SUB_STREAMS == 8
    assert [run.sub_streams(Flags(64), w, pieces) for w in (1, 2, 4, 8, 16, 32)] == [8, 8, 8, 8, 16, 32]
    assert [run.sub_streams(Flags(12), w, pieces) for w in (1, 2, 3, 4, 6)] == [6, 6, 6, 4, 6]
    assert run.sub_streams(Flags(16), 1, [0, 0, 0, 5, 7, 9]) == 2  # three pieces hold training data
    assert run.sub_streams(Flags(16), 1, [0, 3]) == 1
    assert run.sub_streams(Flags(16, sub_streams=4), 2, pieces) == 4
    assert "the corpus has 1 pieces that hold training data (a parquet row group or a .jsonl file each), fewer " \
           "than the 2 ranks" in one_line(run.sub_streams, Flags(16), 2, [0, 3])
    assert "3 ranks cannot share the run's 4 sub-streams evenly: it runs and resumes at 1, 2, 4 ranks" in one_line(
        run.sub_streams, Flags(12, sub_streams=4), 3, pieces)


def test_a_resume_without_the_flag_keeps_the_runs_s(folder, tmp_path, tokenizer):
    recorded = record_of(cfg_of(folder, tmp_path), folder, tokenizer, streams=4)
    assert run.sub_streams(Flags(16), 2, [100] * 34, recorded) == 4  # not the default, 8
    assert run.sub_streams(Flags(16, sub_streams=8), 2, [100] * 34, recorded) == 8  # check_resume names it
    assert "8 ranks cannot share the run's 4 sub-streams evenly: it runs and resumes at 1, 2, 4 ranks" in one_line(
        run.sub_streams, Flags(16), 8, [100] * 34, recorded)
    assert "the checkpoint's stream record: sub_streams is 'four'" in one_line(
        run.sub_streams, Flags(16), 2, [100] * 34, {**recorded, "sub_streams": "four"})


# ---------------------------------------------------------------------------------------
# The states: gathered to rank 0, saved, and shared out at another world size


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_states_gathered_from_two_ranks_resume_at_one_two_and_four(corpus, tokenizer, pack):
    """After step k of W = 2 (k = 0, 3 and the last): rank 0 gathers all S states, keyed by
    sub-stream, rank 1 gets None; saved and loaded (weights_only), each rank of W = 1, 2 and 4
    given its own trains the uninterrupted run's global batches after k."""
    expected = expected_batches(corpus, tokenizer, pack)
    for cut in (0, 3, len(expected)):
        def gather(rank, group):
            feed = feed_of(corpus, tokenizer, pack, 2, rank)
            for _ in range(cut):
                next(feed)
            return run.gather_states(feed, group), feed.state_dict()
        (gathered, state_0), (nothing, state_1) = stream_state.on_gloo_ranks(2, gather)
        assert nothing is None and list(gathered) == list(range(STREAMS))
        assert same_state(gathered, dict(sorted({**state_0, **state_1}.items())))
        saved = through_a_checkpoint({"states": gathered})["states"]
        for world_size in (1, 2, 4):
            ranks = []
            for rank in range(world_size):
                resumed = feed_of(corpus, tokenizer, pack, world_size, rank)
                resumed.load_state_dict(run.owned_states(saved, STREAMS, world_size, rank))
                ranks.append([local_rows(step) for step in resumed])
            assert min(map(len, ranks)) == len(expected) - cut, (cut, world_size)
            assert all(equal(global_batch([r[t] for r in ranks]), expected[cut + t])
                       for t in range(len(expected) - cut)), (cut, world_size)


def test_read_aheads_states_are_gathered_those_of_the_steps_the_loop_took(corpus, tokenizer):
    """Gathered from ReadAhead (the feed a step or two ahead): the states after the steps the
    loop took, which resume with the rest."""
    everything = list(feed_of(corpus, tokenizer, True, 2, 1))

    def gather(rank, group):
        feed = feed_of(corpus, tokenizer, True, 2, rank)
        batches = read_ahead(feed, torch.device("cpu"))
        for _ in range(3):
            next(batches)
        return run.gather_states(batches, group)
    gathered = stream_state.on_gloo_ranks(2, gather)[0]
    resumed = feed_of(corpus, tokenizer, True, 2, 1)
    resumed.load_state_dict(run.owned_states(through_a_checkpoint(gathered), STREAMS, 2, 1))
    assert same_steps(list(resumed), everything[3:])


def test_one_process_gathers_its_own_states(corpus, tokenizer):
    feed = feed_of(corpus, tokenizer, True)
    next(feed)
    assert not dist.is_initialized()
    assert same_state(run.gather_states(feed), feed.state_dict())


def test_states_a_run_cannot_share_out_are_one_line(corpus, tokenizer):
    states = feed_of(corpus, tokenizer, False).state_dict()
    where = "ckpt.pt's sub-stream states"
    cases = [
        ((list(states.values()), STREAMS, 2, 0), f"{where} are a list, not a dict of sub-stream to state"),
        (({**states, "1": states[1]}, STREAMS, 2, 0), f"{where} name a sub-stream '1', not a sub-stream's number"),
        (({True: states[1], **states}, STREAMS, 2, 0), f"{where} name a sub-stream True"),
        (({s: states[s] for s in (0, 1, 2)}, STREAMS, 2, 0), f"{where} lack sub-streams [3], and the run has 4 (0 to "
                                                             "3): the checkpoint is damaged"),
        (({**states, 4: states[0]}, STREAMS, 1, 0), f"{where} hold sub-streams [4], and the run has 4"),
        (({**states, -1: states[0]}, STREAMS, 1, 0), f"{where} hold sub-streams [-1]"),
        ((states, STREAMS, 3, 0), "3 ranks cannot share the run's 4 sub-streams evenly: it runs and resumes at 1, 2, "
                                  "4 ranks"),
    ]
    for args, said in cases:
        assert said in one_line(run.owned_states, *args, source="ckpt.pt"), said
    assert list(run.owned_states(states, STREAMS, 2, 1)) == [1, 3]
    assert list(run.owned_states(states, STREAMS, 4, 2)) == [2]


def test_bench_stream_measures_the_states_a_checkpoint_holds_at_toy_size(tmp_path, capsys):
    """bench_stream.py --sections checkpoint on a 1 MB corpus: 8 packed sub-streams' states from
    2 ranks, what each rank sends, what the checkpoint holds, the time to gather them."""
    results = bench_stream.main(["--mb", "1", "--seq-lens", "512", "--vocab-size", "300", "--data-dir", str(tmp_path),
                                 "--sections", "checkpoint", "--steps", "40"])
    assert list(results) == ["checkpoint"] and list(results["checkpoint"]) == [512]
    row = results["checkpoint"][512]
    assert 1 < row["open_rows"] <= 128 and 0.01 < row["tokens_mb"] <= 8 * 128 * 2 * 512 * 4 / 1e6
    # each rank sends its 4 states, a checkpoint holds the 8: their tokens, and a few KB more
    assert row["tokens_mb"] / 2 < row["sent_mb"] < row["tokens_mb"] / 2 + 0.01
    assert row["tokens_mb"] < row["saved_mb"] < row["tokens_mb"] + 0.01 and row["gather_ms"] > 0
    assert "the states a checkpoint holds" in capsys.readouterr().out


def test_bench_stream_launches_streamed_runs_that_write_only_their_run_folder(tmp_path, capsys):
    """bench_stream.py --sections launch on a 1 MB corpus in 4 row groups: train_dp.py --stream and train_ddp.py
    --stream at 2 ranks reach their first step after their loop begins, save a checkpoint when stopped, and leave
    nothing in the `datasets` cache or TMPDIR, the process tree writing their run folder and no more; the map-style
    run of the same corpus leaves its tokens in the cache (which the column would miss were it not the run's)."""
    from benchmarks import bench_data
    generated = bench_data.prepared_corpus(argparse.Namespace(data=None, mb=1, data_dir=str(tmp_path)))
    results = bench_stream.main(["--data", str(stream_state.in_row_groups(generated, 4)), "--vocab-size", "300",
                                 "--sections", "launch", "--launches", "stream", "stream-2-ranks", "map-style"])
    runs = results["launch"][None]
    assert list(runs) == ["stream", "stream-2-ranks", "map-style"]
    for name, row in runs.items():
        assert 0 < row["ready_s"] < row["first_step_s"] and row["peak_pss_mb"] > 100, name
        assert row["checkpoint_mb"] > 1 and row["tmp_mb"] == 0, name  # the debug model's weights and AdamW's
        assert 0 < row["run_files_mb"] < row["checkpoint_mb"], name  # checkpoint.pt: a link, counted once
        written_there = row["checkpoint_mb"] + row["run_files_mb"] + row["cache_mb"]
        assert written_there <= row["written_mb"] < written_there + 0.5, name
        assert (row["cache_mb"] > 0) == (name == "map-style"), name
    assert "launch to first step" in capsys.readouterr().out
