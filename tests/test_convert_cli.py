"""``lmserve convert``: a transformers checkpoint's architecture picks the converter a plugin
registered; anything else is a clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lmserve_core import cli
from lmserve_core.gguf_file import GGUFFile


def checkpoint(tmp_path: Path, architecture: str) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": [architecture], "hidden_size": 8}))
    return hf


def test_hook_register_converters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = checkpoint(tmp_path, "FakeForCausalLM")
    out = tmp_path / "out.gguf"
    code = cli.main(["convert", str(hf), str(out), "--outtype", "q8_0", "--plugin", "fake_converter"])
    assert code == 0
    assert f"wrote {out}" in capsys.readouterr().out
    with GGUFFile.open(out) as g:
        assert g.architecture == "fake"
        assert g.get("fake.outtype") == "q8_0" and g.get("fake.hidden_size") == 8
    assert cli.main(["convert", "--list", "--plugin", "fake_converter"]) == 0
    assert "FakeForCausalLM  plugin: fake_converter" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: checkpoint(p, "LlamaForCausalLM"), "no installed plugin converts LlamaForCausalLM"),
        (lambda p: p, "no config.json"),
        (lambda p: (p / "config.json").write_text("{") and p, "not readable JSON"),
        (lambda p: (p / "config.json").write_text("{}") and p, "no architectures list"),
    ],
)
def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup, message: str) -> None:  # type: ignore[no-untyped-def]
    hf = setup(tmp_path)
    assert cli.main(["convert", str(hf), str(tmp_path / "o.gguf"), "--plugin", "fake_converter"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


def test_a_converter_missing_its_extra_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lmserve_inkling")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    hf = checkpoint(tmp_path, "InklingForCausalLM")
    assert cli.main(["convert", str(hf), str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "pip install 'lmserve-inkling[convert]'" in err
    assert not (tmp_path / "o.gguf").exists()
