"""Request paths confined under their configured roots (symlinks resolved), refused without echoing them."""

from __future__ import annotations

import os

import pytest

from strop.common.errors import InvalidArgument, NotFound
from strop.common.paths import confine


def test_paths_are_confined_under_their_root(tmp_path):
    (tmp_path / "root" / "m").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "link")
    assert confine(tmp_path / "root", "m") == (tmp_path / "root" / "m").resolve()
    for bad in ("../outside", str(tmp_path / "outside"), "link"):
        with pytest.raises(InvalidArgument, match="outside the allowed root"):
            confine(tmp_path / "root", bad)
    with pytest.raises(NotFound):
        confine(tmp_path / "root", "missing")


def test_paths_longer_than_a_filesystem_allows_are_invalid_argument_without_echoing_them(tmp_path):
    with pytest.raises(InvalidArgument, match="longer than a path can be") as err:
        confine(tmp_path, "m/" + "x" * 5000)
    assert len(str(err.value)) < 200 and str(tmp_path) not in str(err.value)
    with pytest.raises(InvalidArgument, match="is outside the allowed root") as err:
        confine(tmp_path, "/etc/passwd")
    assert str(tmp_path) not in str(err.value), "no absolute server path in what a client sees"
