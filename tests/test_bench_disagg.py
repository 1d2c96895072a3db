"""bench disagg's report: the table and ratios from a saved run (`--from-json`), and its plot."""

import json

import pytest

from hetserve.bench import disagg


def saved() -> dict:
    def row(total):
        return {"prefill_s": 1.0, "transfer_s": 0.01, "transfer_bytes": 1, "decode_s": 2.0, "total_s": total,
                "tok_s": 100 / total, "ttft_median_s": 1.0, "ttft_p95_s": 1.5, "output_tokens": 4, "failed_transfers": 0}
    totals = {"PD@A": (10.0, 4.0), "P@A/D@B": (5.0, 4.0), "PD@B": (8.0, 2.0)}
    return {"devices": ["cpu:threads=1", "cpu:threads=1,weight_format=int8"], "workers": ["cpu0", "cpu1"],
            "concurrency": 4, "long": 512, "short": 64, "command": "hetserve bench disagg",
            "results": {m: {"LILO": row(a), "SISO": row(b)} for m, (a, b) in totals.items()}}


def test_table_gives_each_mode_relative_to_pd_on_a():
    text = disagg.table(saved()["results"], ["LILO", "SISO"])
    ratios = text.split("relative to PD@A")[1].splitlines()
    assert ratios[2].split() == ["LILO", "1.00", "0.50", "0.80"]
    assert ratios[3].split() == ["SISO", "1.00", "1.00", "0.50"]
    speedup = text.split("speed-up of the split")[1].splitlines()
    assert speedup[2].split() == ["LILO", "1.60"] and speedup[3].split() == ["SISO", "0.50"]


def test_from_json_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    path = tmp_path / "disagg.json"
    path.write_text(json.dumps(saved()))
    args = type("Args", (), {"from_json": str(path)})()
    assert disagg.main(args) == 0
    out = capsys.readouterr().out
    assert "P@A/D@B" in out and "LILO" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "disagg.png").stat().st_size > 10_000
