"""Unit tests of the evaluation arithmetic against hand-computed values (no model)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from megatron_ext._paths import atomic_open
from megatron_ext.evaluation.curves import (
    Curve,
    RunCurves,
    loss_difference,
    plot_curves,
    sample_efficiency,
    smooth,
)
from megatron_ext.evaluation.frequency import (
    FrequencyBins,
    bin_labels,
    compare_runs,
    training_counts,
)
from megatron_ext.evaluation.outputs import EvaluationError, write_json
from megatron_ext.evaluation.perplexity import LossTotals, pack_stream
from megatron_ext.evaluation.wikitext import (
    Window,
    detokenize,
    read_wikitext,
    rolling_windows,
    window_batches,
)

# ---------------------------------------------------------------- frequency bins

# relative frequencies 0, 5e-4, 1e-3, 1e-2, 0.1, 0.8885 against edges 1e-3, 1e-2, 1e-1
COUNTS = np.array([0, 5, 10, 100, 1000, 8885])
EDGES = (1e-3, 1e-2, 1e-1)


def test_default_bins_are_the_papers():
    assert bin_labels((1e-7, 1e-6, 1e-5, 1e-4)) == [
        "<1/10M", "1/10M-1/1M", "1/1M-1/100k", "1/100k-1/10k", ">=1/10k",
    ]  # fmt: skip
    assert bin_labels(EDGES) == ["<1/1k", "1/1k-1/100", "1/100-1/10", ">=1/10"]


def test_binning_by_training_frequency():
    bins = FrequencyBins(COUNTS, EDGES)
    # unseen and rare ids in the rarest bin; a frequency equal to an edge goes to the bin above
    assert bins.bins(np.arange(6)).tolist() == [0, 0, 1, 2, 3, 3]


def test_per_bin_statistics_and_empty_bins():
    bins = FrequencyBins(COUNTS, EDGES)
    bins.update(np.array([0, 1, 2, 2, 5, 4]), np.array([1.0, 2.0, 3.0, 5.0, 0.5, 1.5]))
    rows = bins.stats.rows()
    assert [r["tokens"] for r in rows] == [2, 2, 0, 2]
    assert sum(r["tokens"] for r in rows) == 6
    assert [r["share"] for r in rows][:2] == pytest.approx([1 / 3, 1 / 3])
    assert rows[0]["loss"] == pytest.approx(1.5) and rows[1]["loss"] == pytest.approx(4.0)
    assert rows[3]["loss"] == pytest.approx(1.0)
    assert rows[0]["perplexity"] == pytest.approx(math.exp(1.5))
    assert rows[2]["bin"] == "1/100-1/10" and math.isnan(rows[2]["loss"])  # reported, not dropped
    assert bins.stats.overall()["loss"] == pytest.approx(13.0 / 6)


def test_relative_change_against_the_baseline():
    base, other = FrequencyBins(COUNTS, EDGES), FrequencyBins(COUNTS, EDGES)
    base.update(np.array([0, 5]), np.array([2.0, 1.0]))
    other.update(np.array([0, 5]), np.array([1.0, 1.0]))
    rows = compare_runs({"tied": base.stats, "lev": other.stats}, "tied")
    rare = [r for r in rows if r["bin"] == "<1/1k" and r["run"] == "lev"][0]
    assert rare["ppl_change_vs_baseline"] == pytest.approx(math.exp(1.0) / math.exp(2.0) - 1)
    frequent = [r for r in rows if r["bin"] == ">=1/10" and r["run"] == "lev"][0]
    assert frequent["ppl_change_vs_baseline"] == pytest.approx(0.0)
    assert math.isnan([r for r in rows if r["bin"] == "1/1k-1/100"][1]["ppl_change_vs_baseline"])


def test_bad_edges_and_foreign_counts(tmp_path):
    with pytest.raises(EvaluationError, match="increasing"):
        FrequencyBins(COUNTS, (1e-2, 1e-3))
    with pytest.raises(EvaluationError, match="another tokenizer"):
        FrequencyBins(COUNTS, EDGES).bins(np.array([6]))
    np.save(tmp_path / "data_counts.npy", np.ones(7, dtype=np.int64))
    with pytest.raises(EvaluationError, match=r"data_counts.npy counts 7 ids .* has 6"):
        training_counts([str(tmp_path / "data")], 6)
    with pytest.raises(EvaluationError, match="not found"):
        training_counts([str(tmp_path / "other")], 6)


def test_counts_of_blended_datasets_are_summed(tmp_path):
    np.save(tmp_path / "a_counts.npy", np.array([1, 2, 3], dtype=np.int64))
    np.save(tmp_path / "b_counts.npy", np.array([10, 0, 5], dtype=np.int64))
    total = training_counts([str(tmp_path / "a"), str(tmp_path / "b")], 3)
    assert total.tolist() == [11, 2, 8]


# ---------------------------------------------------------------- packing and windows


def test_pack_stream_scores_every_token_but_the_first_once():
    batches = list(pack_stream([np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8])], 3, 2))
    assert len(batches) == 2
    assert batches[0].tokens.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert batches[0].labels.tolist() == [[2, 3, 4], [5, 6, 7]]
    # the last partial sequence [7, 8] is included, padded and masked
    assert batches[1].tokens.tolist() == [[7, 0, 0]] and batches[1].labels.tolist() == [[8, 0, 0]]
    assert batches[1].loss_mask.tolist() == [[1.0, 0.0, 0.0]]
    assert sum(b.num_targets for b in batches) == 8 - 1


def test_rolling_windows_by_hand():
    assert rolling_windows(10, 4, 2) == [
        Window(0, 4, 0), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8),
    ]  # fmt: skip
    assert rolling_windows(3, 4, 2) == [Window(0, 3, 0)]
    assert rolling_windows(5, 4, 3) == [Window(0, 4, 0), Window(1, 5, 4)]
    assert sum(w.end - w.scored_after for w in rolling_windows(1000, 64, 16)) == 1000
    with pytest.raises(EvaluationError, match="stride"):
        rolling_windows(10, 4, 5)


def test_window_batches_mask_only_new_targets():
    stream = np.array([0, 11, 12, 13, 14, 15])  # EOD + 5 tokens
    (batch,) = list(window_batches([stream], context=4, stride=3, micro_batch_size=8))
    assert batch.tokens.tolist() == [[0, 11, 12, 13], [11, 12, 13, 14]]
    assert batch.labels.tolist() == [[11, 12, 13, 14], [12, 13, 14, 15]]
    assert batch.loss_mask.tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]


# ---------------------------------------------------------------- wikitext


@pytest.mark.parametrize(
    "tokenized, expected",
    [
        ("a cat @-@ like dog", "a cat-like dog"),
        ("1 @,@ 000 and 3 @.@ 5 km", "1,000 and 3.5 km"),
        (
            "one , two . Three ; four : five ! six ? seven",
            "one, two. Three; four: five! six? seven",
        ),
        ('he ( roughly ) said " yes " [ 1 ]', 'he (roughly) said "yes" [1]'),
        (" = = Early life = = ", " == Early life == "),
        ("the cat 's toy", "the cat's toy"),
        ("the players ' coach", "the players' coach"),
    ],
)
def test_detokenize(tokenized, expected):
    assert detokenize(tokenized) == expected


def test_read_wikitext_splits_articles_at_titles(tmp_path):
    path = tmp_path / "wiki.test.tokens"
    path.write_text(
        " \n = First = \n \n Text one . \n \n = = Part = = \n \n More . \n"
        " \n = Second = \n \n Two . \n"
    )
    articles = read_wikitext(str(path))
    assert len(articles) == 2
    assert "= = Part = =" in articles[0] and articles[1].startswith(" = Second = ")
    bad = tmp_path / "notes.txt"
    bad.write_text("just some text\n")
    with pytest.raises(EvaluationError, match=r"notes.txt is not in the wikitext format"):
        read_wikitext(str(bad))
    with pytest.raises(EvaluationError, match="does not exist"):
        read_wikitext(str(tmp_path / "missing.tokens"))


# ---------------------------------------------------------------- curves


def _run(name, tokens, loss):
    curve = Curve(np.array(tokens, dtype=float), np.array(loss, dtype=float))
    return RunCurves(name, train=curve, validation=curve, source=name)


def test_sample_efficiency_interpolates_between_evaluations():
    lev = _run("lev", [100, 200, 300], [5.0, 4.0, 3.0])
    tied = _run("tied", [100, 200, 300], [5.5, 4.5, 3.5])
    result = sample_efficiency(lev, tied)
    assert result.tokens == pytest.approx(250.0)  # 3.5 is half way between 4.0 and 3.0
    assert result.ratio == pytest.approx(300 / 250)
    assert "1.20x fewer tokens" in result.message()


def test_sample_efficiency_when_never_reached_or_reached_at_once():
    slow = _run("slow", [100, 200], [6.0, 5.0])
    fast = _run("fast", [100, 200], [4.0, 3.0])
    never = sample_efficiency(slow, fast)
    assert never.tokens is None and never.ratio is None
    assert never.message() == (
        "slow never reaches fast's final validation loss 3.0000 (its best is 5.0000 at 200 tokens)"
    )
    at_once = sample_efficiency(fast, slow)
    assert at_once.tokens == 100 and at_once.at_first_point and at_once.ratio == 2.0


def test_loss_difference_interpolates_the_reference_inside_its_range():
    reference = Curve(np.array([100.0, 300.0]), np.array([5.0, 3.0]))
    run = Curve(np.array([50.0, 100.0, 200.0, 300.0, 400.0]), np.array([9, 4.9, 3.9, 2.95, 1]))
    delta = loss_difference(run, reference)
    assert delta.tokens.tolist() == [100.0, 200.0, 300.0]  # 50 and 400 lie outside
    assert delta.loss.tolist() == pytest.approx([-0.1, -0.1, -0.05])
    assert loss_difference(Curve(np.array([500.0]), np.array([1.0])), reference) is None


def test_more_than_two_arms_are_drawn_against_the_reference(tmp_path):
    import matplotlib.image

    runs = [
        _run(name, [100, 200, 300], [5.0 + d, 4.0 + d, 3.0 + d])
        for name, d in (("tied", 0.0), ("lev", -0.05), ("albert", 0.03))
    ]
    written = plot_curves(runs, str(tmp_path / "curves.png"), 0.5, reference="tied")
    assert written == [str(tmp_path / "curves.png"), str(tmp_path / "curves_absolute.png")]
    assert (
        matplotlib.image.imread(written[0]).shape[1] > matplotlib.image.imread(written[1]).shape[1]
    )  # two panels side by side
    two = plot_curves(runs[:2], str(tmp_path / "two.png"), reference="tied")
    assert two == [str(tmp_path / "two.png")] and not (tmp_path / "two_absolute.png").exists()


def test_smoothing_is_the_debiased_ema():
    assert smooth(np.array([1.0, 3.0]), 0.5).tolist() == pytest.approx([1.0, 1.75 / 0.75])
    assert smooth(np.array([1.0, 3.0]), 0.0).tolist() == [1.0, 3.0]


# ---------------------------------------------------------------- outputs


def test_results_are_written_atomically(tmp_path):
    path = tmp_path / "out" / "r.json"
    with pytest.raises(RuntimeError):
        with atomic_open(str(path)) as handle:
            handle.write("half")
            raise RuntimeError("interrupted")
    assert not path.exists() and os.listdir(path.parent) == []
    write_json(str(path), {"loss": float("nan"), "tokens": 3})
    assert path.read_text() == '{\n  "loss": null,\n  "tokens": 3\n}\n'


def test_loss_totals():
    totals = LossTotals()
    totals.update(np.array([1, 2]), np.array([1.0, 2.0]))
    totals.update(np.array([3]), np.array([3.0]))
    assert totals.tokens == 3 and totals.loss == 2.0 and totals.perplexity == math.exp(2.0)


def test_read_text_file_names_the_byte_offset(tmp_path):
    from megatron_ext.evaluation.outputs import read_text_file

    path = tmp_path / "t.txt"
    path.write_bytes("ok \u00e9".encode("utf-8") + b" \xff tail")
    with pytest.raises(EvaluationError, match=r"byte 0xff at byte offset 6 \(invalid start byte\)"):
        read_text_file(str(path))
    assert read_text_file(str(path), "latin-1").endswith("\xff tail")
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\xff" * 8)
    with pytest.raises(EvaluationError, match="zstd-compressed data: decompress it first"):
        read_text_file(str(path))
    with pytest.raises(EvaluationError, match="not a text encoding"):
        read_text_file(str(path), "no-such-codec")
