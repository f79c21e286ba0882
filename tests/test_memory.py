import json

import pytest

from tangram.memory import main


def test_memory_cli_figure8_setting(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama-3.1-8b", "--tokens", "100000", "--rho", "0.3", "--hp", "4", "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["layout"]: r for r in out["layouts"]}
    full = rows["monolithic full"]
    # full KV of 100K tokens: 2 * 32 layers * 8 heads * 128 * 2 bytes = 131072 B/token, rounded to 16-token pages
    assert full["bytes_reserved"] == 6250 * 16 * 131072
    assert full["fragmentation"] == pytest.approx(0.0)
    # ragged clustered <= ragged adjacent < monolithic static: clustering and ragged paging reclaim memory
    assert rows["ragged clustered"]["bytes_reserved"] <= rows["ragged adjacent"]["bytes_reserved"]
    assert rows["ragged adjacent"]["bytes_reserved"] < rows["monolithic static (BR)"]["bytes_reserved"]
    # the same budgets are live in all static layouts; only the reservation differs
    assert rows["ragged clustered"]["bytes_live"] == rows["monolithic static (BR)"]["bytes_live"]
    for r in rows.values():
        assert 0.0 <= r["fragmentation"] < 1.0
    assert rows["monolithic dynamic"]["reclaim_pages"] > 0


def test_memory_cli_bad_input(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "nope"])
    assert e.value.code == 2
    assert "unknown model" in capsys.readouterr().err
