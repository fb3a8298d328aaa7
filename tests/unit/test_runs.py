from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lightship.errors import RunError
from lightship.runs import RunDir, atomic_path, check_writable, sha256_file


def test_atomic_path_leaves_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half-writ")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]  # no temp file left behind


def test_atomic_path_replaces_on_success(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "model.bin"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"


def test_manifest_record_and_sha(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    f = run.root / "a.txt"
    f.write_text("hello")
    assert sha256_file(f) == hashlib.sha256(b"hello").hexdigest()
    run.record("a", {"file": "a.txt"})
    run.record("b", {"file": "b.txt"})
    run.record("a", {"file": "a2.txt"})
    assert run.manifest()["artifacts"] == {"a": {"file": "a2.txt"}, "b": {"file": "b.txt"}}
    run.forget("a")
    assert run.artifact("a") is None and run.artifact("b") == {"file": "b.txt"}


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2]",
        "null",
        '{"artifacts": []}',
        '{"artifacts": {"onnx-fp32": {}}}',
        '{"artifacts": {"onnx-fp32": "x"}}',
    ],
)
def test_malformed_manifest_is_a_run_error(tmp_path: Path, text: str) -> None:
    run = RunDir(tmp_path)
    run.manifest_path.write_text(text)
    with pytest.raises(RunError, match="manifest.json is malformed"):
        run.manifest()


def test_check_writable_makes_missing_folders(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out.json"
    check_writable(out)
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []  # the probe file is gone


def test_check_writable_refuses_a_folder_in_place_of_the_file(tmp_path: Path) -> None:
    (tmp_path / "pareto.png").mkdir()
    with pytest.raises(RunError, match=r"pareto.png is a folder where a file goes: move it away"):
        check_writable(tmp_path / "report.json", tmp_path / "pareto.png")


def test_check_writable_names_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("")
    with pytest.raises(RunError, match=r"runs is a file, not a folder$"):
        check_writable(tmp_path / "runs" / "r" / "manifest.json")


def test_check_writable_reports_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_: object) -> None:  # root ignores chmod, so the OS refusal is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.TemporaryFile", refuse)
    with pytest.raises(RunError) as err:
        check_writable(tmp_path / "model.onnx")
    assert str(err.value) == (
        f"cannot write {tmp_path / 'model.onnx'}: Permission denied: "
        "check the path and its permissions"
    )
