"""``verl-comm nccl lint|show|topo|autotune`` and the autotune selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_comm.bench import autotune as at
from verl_comm.cli.nccl import main, parse_size

DATA = Path(__file__).parent / "data"
ADVICE = ["NCCL_ASYNC_ERROR_HANDLING=0", "NCCL_SOCKET_TIMEOUT=1200", "NCCL_NSOCKS_PERTHREAD=8",
          "NCCL_BUFFSIZE=2097152", "NCCL_MIN_NRINGS=4", "NCCL_IB_DISABLE=1"]  # fmt: skip


def test_lint_advice_table_and_exit_code(capsys):
    assert main(["lint", *ADVICE]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("severity variable")
    for a in ADVICE:
        assert a.split("=")[0] in out
    assert main(["lint", "--json", *ADVICE]) == 1
    got = json.loads(capsys.readouterr().out)
    assert sorted(f["variable"] for f in got) == sorted(a.split("=")[0] for a in ADVICE)
    assert {f["severity"] for f in got} == {"error", "warning"}


def test_lint_clean_env_and_presets_exit_zero(capsys, monkeypatch):
    assert main(["lint", "NCCL_DEBUG=WARN"]) == 0
    assert "no findings" in capsys.readouterr().out
    for name in ("pytorch-safety", "cloud-tcp", "ib-multinode", "aws-efa"):
        assert main(["lint", "--preset", name]) == 0
    monkeypatch.setenv("NCCL_BUFFSIZE", "2M")  # no VAR=VALUE: lints os.environ
    assert main(["lint"]) == 1
    assert "NCCL_BUFFSIZE" in capsys.readouterr().out
    assert main(["lint", "NOEQUALS"]) == 2


def test_show_preset(capsys):
    assert main(["show", "ib-multinode"]) == 0
    out = capsys.readouterr().out
    assert "NCCL_IB_TIMEOUT" in out and "22" in out and "init: timeout_s" in out
    assert main(["show", "aws-efa", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {"variable": "FI_PROVIDER", "value": "efa"}.items() <= got["entries"][-4].items()
    assert main(["show"]) == 0 and "cloud-tcp" in capsys.readouterr().out
    assert main(["show", "fast"]) == 2


def test_topo_from_file(capsys):
    assert main(["topo", str(DATA / "topo_2xh200_nv18.txt"), "--gpu", "NVIDIA H200"]) == 0
    assert "NV18" in capsys.readouterr().out
    f = str(DATA / "topo_8xa100_sxm_degraded.txt")
    assert main(["topo", f, "--gpu", "NVIDIA A100-SXM4-80GB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["nvlink_problems"][0].startswith("GPU2-GPU5")


def test_parse_size():
    assert parse_size("64K") == 65536 and parse_size("1M") == 1 << 20
    assert parse_size("4096") == 4096 and parse_size("2MiB") == 2 << 20
    with pytest.raises(ValueError, match="'abc'"):
        parse_size("abc")


def test_autotune_picks_fastest_per_size(monkeypatch):
    times = {"pytorch-safety": {1024: 50.0, 1 << 20: 900.0}, "cloud-tcp": {1024: 60.0, 1 << 20: 400.0},
             "aws-efa": None}  # fmt: skip

    def fake(preset, sizes, *args, **kw):
        if times[preset] is None:
            return at.PresetResult(preset, False, error="exit 4: boom")
        by = {s: {"measured_bytes": s, "time_us": times[preset][s], "busbw_GBps": s / times[preset][s] / 1e3}
              for s in sizes}  # fmt: skip
        return at.PresetResult(preset, True, by)

    monkeypatch.setattr(at, "run_preset", fake)
    rep = at.autotune([1 << 20, 1024], ["pytorch-safety", "cloud-tcp", "aws-efa"], nproc=2)
    assert rep.fastest == {1024: "pytorch-safety", 1 << 20: "cloud-tcp"}
    assert rep.recommended == "cloud-tcp"  # one win each: lower total time wins
    text = at.format_report(rep)
    assert "| 1024 | 50.0 us" in text and "aws-efa failed: exit 4: boom" in text
    with pytest.raises(ValueError, match="unknown presets"):
        at.autotune([1024], ["fast"])
    with pytest.raises(ValueError, match="positive"):
        at.autotune([0])


@pytest.mark.timeout(240)
def test_autotune_end_to_end_gloo(tmp_path, capsys):
    # one preset keeps it to one benchmark launch; the selection is tested above
    argv = ["autotune", "--sizes", "4K,64K", "--presets", "nvlink-single-node",
            "--nproc", "2", "--backend", "gloo", "-n", "2", "-w", "1", "--timeout", "120",
            "--out", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rep["results"]] == ["nvlink-single-node"]
    for r in rep["results"]:
        assert r["ok"], r["error"]
        assert set(r["by_size"]) == {"4096", "65536"}
        assert all(v["time_us"] > 0 for v in r["by_size"].values())
    assert rep["recommended"] == "nvlink-single-node"
    assert rep["fastest"] == {"4096": "nvlink-single-node", "65536": "nvlink-single-node"}
    assert (tmp_path / "nccl_autotune.md").read_text().startswith("# NCCL preset autotune")
