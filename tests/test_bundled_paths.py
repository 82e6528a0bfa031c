"""No bundled file records a machine's layout, and new artefacts record where their model came from portably."""

from __future__ import annotations

import re
from pathlib import Path

import retrospec
from retrospec.identity import portable_path

MACHINE_PATH = re.compile(r"(?<![\w.])/(root|home|work|tmp)/")
PACKAGE = Path(retrospec.__file__).parent


def test_bundled_files_hold_no_machine_paths():
    bundled = [p for p in PACKAGE.rglob("*") if p.suffix in {".json", ".txt", ".jinja", ".md"} and p.is_file()]
    assert any(p.name == "manifest.json" for p in bundled)  # the zoo's records are among them
    offenders = {str(p.relative_to(PACKAGE)): m.group(0) for p in bundled
                 for m in [MACHINE_PATH.search(p.read_text(encoding="utf-8", errors="replace"))] if m}
    assert offenders == {}


def test_portable_path_names_named_models_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path / "home"))
    named = tmp_path / "home" / "models" / "smollm2-135m"
    named.mkdir(parents=True)
    assert portable_path(named) == "smollm2-135m"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "block").mkdir(parents=True)
    assert portable_path(tmp_path / "runs" / "block") == str(Path("runs") / "block")
    assert portable_path("relative/dir") == "relative/dir"
    assert portable_path("/elsewhere/model") == "/elsewhere/model"  # a user's own choice stays as given
    assert portable_path(None) is None


def test_target_record_is_portable(saved_models, monkeypatch):
    from retrospec.identity import target_record
    from retrospec.models import load_model

    loaded = load_model(saved_models.target, role="target")
    monkeypatch.chdir(saved_models.target.parent)
    assert target_record(loaded.model, loaded.tokenizer, str(saved_models.target))["path"] == saved_models.target.name
