"""`python -m benchmarks table`: the README's performance table from a tiny synthetic sweep result (CPU, no jax)."""

import json

import pytest

from benchmarks import table

RESULT = {
    "summary": {"shapes": 3, "dispatch_us": {"forward": 25.04, "apply_gradients": 30.5, "floor": 22.6},
                "fwd": {"median": 1.5, "share_ge_1": 1.0, "share_ge_1_2": 0.667, "min": 1.1, "worst": []},
                "bwd": {"median": 1.25, "share_ge_1": 0.667, "share_ge_1_2": 0.333, "min": 0.9, "worst": []},
                "fwdbwd": {"median": 1.3, "share_ge_1": 0.667, "share_ge_1_2": 0.5, "min": 0.95}},
    "named": {"base": {"fwd": 1.2, "bwd": 2.0, "fwdbwd": 1.8}, "zipf": None},
    "meta": {"device": "NVIDIA H200"},
}


def test_table_text():
    text = table.table(RESULT, "x.json")
    assert "over 3 drawn shard shapes (`x.json`; device NVIDIA H200)" in text
    assert "| forward | 1.50x | 100% | 66.7% | 1.10x |" in text
    assert "| backward | 1.25x | 66.7% | 33.3% | 0.90x |" in text
    assert "| fwd+bwd | 1.30x | 66.7% | 50% | 0.95x |" in text
    assert "| base | 1.20x | 2.00x | 1.80x |" in text
    assert "Not measured on both sides in this run: zipf." in text
    assert "forward 25.0, apply_gradients 30.5 (JAX's floor, a jitted `x + 1`: 22.6)" in text


def test_write_between_markers(tmp_path, capsys):
    sweep = tmp_path / "sweep-20990101-merged.json"
    sweep.write_text(json.dumps(RESULT))
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{table.BEGIN}\nold table\n{table.END}\noutro\n")
    table.main(["--sweep", str(sweep), "--write", str(doc)])
    text = doc.read_text()
    assert text.startswith(f"intro\n{table.BEGIN}\nFBGEMM time") and text.endswith(f"{table.END}\noutro\n")
    assert "old table" not in text and "| forward | 1.50x |" in text
    table.main(["--sweep", str(sweep), "--write", str(doc)])  # idempotent
    assert doc.read_text() == text
    assert "| forward | 1.50x |" in capsys.readouterr().out


def test_write_without_markers_fails(tmp_path):
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps(RESULT))
    doc = tmp_path / "doc.md"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit) as e:
        table.main(["--sweep", str(sweep), "--write", str(doc)])
    assert e.value.code == 1 and doc.read_text() == "no markers\n"


def test_configured_sweep_exists():
    assert table.resolve(table.SWEEP)
    assert table.resolve("newest").endswith(".json")


def test_by_class(tmp_path, capsys):
    """`--by-class`: drawn shards grouped by row width, bag length and dtype; named shards left out."""
    def row(name, dims, bags, fwd, wd="float16"):
        return {"shard": name, "dims": dims, "bags": bags, "weights_dtype": wd,
                "ratio": {"fwd": fwd, "bwd": 1.0, "fwdbwd": 1.0}}

    result = {**RESULT, "table": [row("s000", [160], [1.5], 0.7), row("s001", [192, 256], [2.0, 3.9], 0.9),
                                  row("s002", [64, 192], [30.0, 1.0], 1.6), row("s003", [64], [12.0], 1.8, "float32"),
                                  row("s004", [160], [2.0], 1.1), row("base", [128], [20.0], 9.9)]}
    assert table.shard_class(result["table"][1]) == "D>128 short float16"
    assert table.shard_class(result["table"][2]) == "mixed long float16"
    text = table.by_class(result)
    assert "| D>128 short float16 | 3 | 0.90x / 0.70x | 1.00x / 1.00x | 1.00x / 1.00x |" in text
    assert "| D<=128 long float32 | 1 | 1.80x / 1.80x |" in text and "9.90x" not in text
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps(result))
    table.main(["--sweep", str(sweep), "--by-class"])
    assert capsys.readouterr().out == text
