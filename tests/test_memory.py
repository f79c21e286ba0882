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


@pytest.mark.parametrize("gpu,tp,hint", [("h100-80gb", 1, "--tp 4 leaves some"), ("a100-80gb", 2, "--tp 4 leaves some"),
                                         ("h200", 1, "--tp 2 leaves some")])
def test_a_model_too_large_for_the_gpu_names_the_degree_that_fits(gpu, tp, hint):
    """Llama-3.1-70B's 131 GiB of weights leave no KV memory on one 80 GB GPU: the error says so and names the
    fewest GPUs (a degree dividing its 8 KV heads) whose shards leave some, which then gives a pool."""
    import dataclasses

    from tangram.config import EngineConfig, get_gpu, get_model, kv_pool_bytes
    from tangram.errors import ConfigError

    m, g = get_model("llama-3.1-70b"), get_gpu(gpu)
    with pytest.raises(ConfigError, match="leaves no KV memory") as e:
        kv_pool_bytes(m, g, EngineConfig(tp=tp, heads_per_group=1))
    assert str(e.value).endswith(hint)
    fit = int(hint.split()[1])
    assert kv_pool_bytes(m, g, dataclasses.replace(EngineConfig(heads_per_group=1), tp=fit)) > 0
    with pytest.raises(ConfigError, match="leaves no KV memory"):  # the fewest: half as many leave none
        kv_pool_bytes(m, g, dataclasses.replace(EngineConfig(heads_per_group=1), tp=fit // 2))


@pytest.mark.parametrize("tokens", ["1000000000000", "131072"])
def test_memory_cli_beyond_the_context_window_is_an_error(capsys, tokens):
    """A prompt the model cannot hold (with its output token) is an error, not a table of zeros (131,072 is the
    window itself: the output token does not fit) nor an out-of-memory traceback (10^12)."""
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama-3.1-8b", "--tokens", tokens])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--tokens {tokens}: beyond llama-3.1-8b's context window of 131,072 tokens" in err
    assert err.count("\n") == 1


def test_memory_cli_output_cut_by_head_is_quiet():
    """``tangram-mem | head -1``: the reader closes the pipe; no traceback, exit 0."""
    import subprocess
    import sys

    r = subprocess.run(f"{sys.executable} -m tangram.memory --tokens 4000 | head -c 5", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and len(r.stdout) == 5
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_memory_cli_smollm2_takes_a_head_group_size_that_divides_its_kv_heads(capsys):
    """SmolLM2 has 3 KV heads: without --hp the tool uses H_p = 3 (the largest divisor <= the default 4), not an
    error about H_p = 4; --hp 4 given explicitly is still an error."""
    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m", "--tokens", "4000", "--json"])
    assert e.value.code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["hp"] == 3
    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m", "--tokens", "4000", "--hp", "4"])
    assert e.value.code == 2 and "--hp 4 must divide smollm2-135m's 3 KV heads" in capsys.readouterr().err
