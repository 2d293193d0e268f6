"""Result files name the source tree that produced them (mobilenet.reporting.source_tree): the checkout's commit,
marked when tracked files differ from it; what MOBILENET_TREE says when set; and plainly unknown without git."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mobilenet.reporting import TREE_ENV, environment, source_tree

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A one-commit repository with a tracked file."""
    monkeypatch.delenv(TREE_ENV, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return tmp_path


@needs_git
def test_a_clean_checkout_is_named_by_its_commit(repo):
    assert source_tree(repo) == _git(repo, "rev-parse", "--short", "HEAD")


@needs_git
def test_changed_tracked_files_are_marked_and_untracked_ones_are_not(repo):
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "notes.txt").write_text("untracked\n")
    assert source_tree(repo) == commit
    (repo / "a.py").write_text("x = 2\n")
    assert source_tree(repo) == commit + "+changes"


def test_without_git_metadata_the_tree_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv(TREE_ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    (tmp_path / "a.py").write_text("x = 1\n")
    assert source_tree(tmp_path) == "unknown (no git metadata)"


@needs_git
def test_the_environment_variable_names_a_copy_whatever_its_metadata_says(repo, monkeypatch):
    monkeypatch.setenv(TREE_ENV, "1642c96 (working tree copied to the GPU machine)")
    assert source_tree(repo) == "1642c96 (working tree copied to the GPU machine)"


def test_environment_carries_the_tree(monkeypatch):
    monkeypatch.setenv(TREE_ENV, "abc1234")
    env = environment(torch.device("cpu"))
    assert env["tree"] == "abc1234"
