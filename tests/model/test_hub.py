"""--model as a Hub repo id: resolved from a pre-populated Hugging Face cache, nothing fetched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from irminsul.model import default_model_dir
from irminsul.model.hub import ModelNotFound, resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _cache_with_default_model(root: Path) -> Path:
    """A Hugging Face hub cache holding the embedded model as repo ``irminsul-test/tiny`` (the
    cache's layout: refs/main names the snapshot directory)."""
    repo = root / "models--irminsul-test--tiny"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(default_model_dir(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def _resolve_offline(cache: Path, name: str) -> subprocess.CompletedProcess:
    """resolve_model in a fresh interpreter (huggingface_hub reads its settings at import)."""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    code = ("import sys; from irminsul.model.hub import resolve_model\n"
            "try:\n    print(resolve_model(sys.argv[1]))\n"
            "except FileNotFoundError as err:\n    print(err, file=sys.stderr); sys.exit(3)")
    return subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True,
                          text=True, timeout=120)


def test_repo_id_resolves_to_the_cached_snapshot(tmp_path: Path) -> None:
    snapshot = _cache_with_default_model(tmp_path)
    done = _resolve_offline(tmp_path, "irminsul-test/tiny")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot
    pinned = _resolve_offline(tmp_path, f"irminsul-test/tiny@{REVISION}")
    assert Path(pinned.stdout.strip()) == snapshot


def test_missing_repo_offline_says_so(tmp_path: Path) -> None:
    done = _resolve_offline(tmp_path, "irminsul-test/absent")
    assert done.returncode == 3
    assert "not in the Hugging Face cache" in done.stderr and "HF_HUB_OFFLINE" in done.stderr


def test_directories_win_and_bad_names_are_named(tmp_path: Path) -> None:
    assert resolve_model(default_model_dir()) == default_model_dir()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model(tmp_path / "a-file")
    with pytest.raises(ModelNotFound, match="nor a Hub repo id"):
        resolve_model(tmp_path / "no" / "such" / "dir")


def test_serving_commands_take_a_repo_id(tmp_path: Path) -> None:
    """`irminsul consistency --model REPO` runs the model found in the cache."""
    _cache_with_default_model(tmp_path)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "irminsul.cli", "-q", "consistency", "--model",
                           "irminsul-test/tiny", "--requests", "1", "--tokens", "2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "KL" in done.stdout
