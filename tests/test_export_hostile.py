"""Export against a hostile checkpoint and a moving target (issue 24), through the CLI entry point.

- train_state.json is only as trusted as whoever can write checkpoints/ (the marker is re-sealed here): a model
  it describes that the checkpoint does not hold is refused in one line, before anything is allocated (a
  petabyte embedding would otherwise be a RuntimeError from the allocator, or the OOM killer); and when the
  `.metadata` is rewritten to agree with it, the sizes must still fit in the bytes the checkpoint holds;
- `--out` is checked again just before the swap, and the swap only replaces a missing, empty or own-marked
  directory. "Meanwhile" (the minutes an export takes) is a directory made by another process during the
  export: the test makes it from inside the export's own write of model.safetensors (monkeypatched
  `save_file` wrapper that calls the real one, then creates it), the only way to land in that window
  deterministically.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from faultkit import fresh_root, make_dataset, sets
from llmcluster.cli import main
from llmcluster.export import hf
from llmcluster.storage.layout import COMPLETE_MARKER


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data_root = make_dataset(tmp_path_factory.mktemp("export") / "storage")
    root = fresh_root(data_root, tmp_path_factory.mktemp("run"))
    assert main(["train", "-c", "llm_tiny", "--root", str(root),
                 *sets(train__steps=2, checkpoint__interval_steps=2)]) == 0
    return root


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _reseal(step, name: str, data: bytes) -> None:
    """Rewrite a file of a checkpoint and its digest in the marker, as anyone who can write it can."""
    (step / name).write_bytes(data)
    marker = json.loads((step / COMPLETE_MARKER).read_text())
    marker["files"][name] = hashlib.sha256(data).hexdigest()
    (step / COMPLETE_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("change,needle", [
    ({"d_model": 2**24, "n_heads": 2**10, "vocab_size": 2**30}, "does not match its checkpoint"),
    ({"vocab_size": 2**40}, "does not match its checkpoint"),
    ({"n_layers": 10**6}, "says 1000000 layers"),
])
def test_train_state_describing_another_model_is_refused_before_allocating(capsys, trained, tmp_path,
                                                                           change, needle):
    root = tmp_path / "copy"
    shutil.copytree(trained, root, symlinks=True)
    step = root / "checkpoints" / "llm-tiny" / "step_2"
    state = json.loads((step / "train_state.json").read_text())
    state["config"]["model"].update(change)
    _reseal(step, "train_state.json", json.dumps(state).encode())
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root, "--out", tmp_path / "hf")
    one_line(code, err, str(step), needle)
    assert not (tmp_path / "hf").exists()


def test_metadata_and_train_state_agreeing_on_a_huge_model_are_refused(capsys, trained, tmp_path):
    """Both rewritten (and re-sealed) to agree: the sizes must still fit in the bytes the checkpoint holds."""
    import pickle

    import torch

    from llmcluster.checkpoint.safe_load import read_metadata_file

    root = tmp_path / "copy"
    shutil.copytree(trained, root, symlinks=True)
    step = root / "checkpoints" / "llm-tiny" / "step_2"
    state = json.loads((step / "train_state.json").read_text())
    state["config"]["model"]["vocab_size"] = 2**34
    _reseal(step, "train_state.json", json.dumps(state).encode())
    md = read_metadata_file(step / ".metadata")
    for k in ("model.embed_tokens.weight", "model.lm_head.weight"):
        if k in md.state_dict_metadata:
            md.state_dict_metadata[k].size = torch.Size([2**34, md.state_dict_metadata[k].size[1]])
    _reseal(step, ".metadata", pickle.dumps(md))
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root, "--out", tmp_path / "hf")
    one_line(code, err, str(step), "describes a", "bytes")


def _make_out_meanwhile(monkeypatch, out, make):
    real = hf.save_file

    def save_then_make(*a, **k):
        real(*a, **k)
        make(out)
    monkeypatch.setattr(hf, "save_file", save_then_make)


def _foreign(out):
    out.mkdir(exist_ok=True)
    (out / "thesis.tex").write_text("years of work")


def test_out_created_meanwhile_is_not_replaced(capsys, trained, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    _make_out_meanwhile(monkeypatch, out, _foreign)
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)
    one_line(code, err, "not empty and not an earlier llmcluster export")
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_our_export_replaced_meanwhile_by_something_else_is_not_replaced(capsys, trained, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    assert cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)[0] == 0

    def swap_in_foreign(d):
        shutil.rmtree(d)
        _foreign(d)
    _make_out_meanwhile(monkeypatch, out, swap_in_foreign)
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)
    one_line(code, err, "not empty and not an earlier llmcluster export")
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_the_swap_itself_puts_back_what_is_not_ours(capsys, trained, tmp_path, monkeypatch):
    """The last check and the rename are two steps: what the swap took out is looked at, and put back."""
    out = tmp_path / "hf"
    assert cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)[0] == 0
    checks = []
    real_check = hf.check_export_target

    def check_then_change(root, target):   # the re-check passes; right after it, the directory changes
        got = real_check(root, target)
        checks.append(target)
        if len(checks) == 2:
            for f in target.iterdir():
                f.unlink()
            _foreign(target)
        return got
    monkeypatch.setattr(hf, "check_export_target", check_then_change)
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)
    one_line(code, err, "changed while exporting", "left as it is")
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_empty_directory_made_meanwhile_is_filled(capsys, trained, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    _make_out_meanwhile(monkeypatch, out, lambda d: d.mkdir())
    code, err = cli(capsys, "export", "--run", "llm-tiny", "--root", trained, "--out", out)
    assert code == 0, err
    assert hf.is_our_export(out) and (out / "model.safetensors").is_file()
