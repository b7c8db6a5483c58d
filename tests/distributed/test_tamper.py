"""Tampered or damaged checkpoints never load silently: every case raises ``CheckpointError`` naming the file
and the field, on every rank, through ``load_checkpoint``, ``zeroshard convert`` and ``init_inference``.

Edits that leave the manifest's checksum stale are caught by it; to reach the checks behind it (bounds,
plain names, schema), the same edits are also made with the checksum recomputed ("resealed"), as a buggy
writer or a deliberate edit would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from zeroshard.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 64, 8


def gpt2(meta: bool = False):
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(0)
    if meta:
        import zeroshard

        with zeroshard.init_empty_weights():
            return transformers.GPT2LMHeadModel(config)
    return transformers.GPT2LMHeadModel(config)


def engine_for_gpt2():
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zeroshard.initialize(model=gpt2(), config=config)
    return engine


# client_state with a tensor, and a user dict that looks like the encoding's own tensor reference
CLIENT = {"epoch": 3, "tricky": {"__zeroshard_tensor__": "client.0"}, "nested": [{"__zeroshard_dict__": 1}]}


def engine_for_gpt2_tp(tp: int):
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": tp},
    }
    engine, *_ = zeroshard.initialize(model=gpt2(), config=config)
    return engine


def save_worker(directory: str, tp_directory: str) -> None:
    """The checkpoint every case edits, and a tensor-parallel one (TP=2) for the split-record cases."""
    engine = engine_for_gpt2_tp(2)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(tp_directory, tag="good")
    engine.destroy()
    engine = engine_for_gpt2()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(engine.global_rank))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(directory, tag="good", client_state={**CLIENT, "best": torch.tensor([1.5, 2.5])})


# -- the edits -----------------------------------------------------------------------------------------
def _manifest_path(d: Path) -> Path:
    return d / "good" / "manifest.json"


def _edit_manifest(d: Path, change, reseal: bool) -> None:
    from zeroshard.checkpoint.manifest import seal

    data = json.loads(_manifest_path(d).read_text())
    body = {k: v for k, v in data.items() if k != "checksum"}
    body = change(body)
    _manifest_path(d).write_text(json.dumps(seal(body) if reseal else {**body, "checksum": data["checksum"]}))


def _first_piece(body: dict) -> list:
    return next(iter(body["params"].values()))["pieces"][0]


def _set(index: int, value):
    def change(body):
        _first_piece(body)[index] = value(_first_piece(body)[index]) if callable(value) else value
        return body

    return change


def _past_tensor_end(body: dict) -> dict:
    """The last piece of the first piece's saved tensor moved past the tensor's end (order kept: the read bound
    catches it)."""
    file, key = _first_piece(body)[:2]
    pieces = [p for entry in body["params"].values() for p in entry["pieces"] if p[:2] == [file, key]]
    max(pieces, key=lambda p: p[2])[2] += 10**9
    return body


def _foreign_file(name: str):
    def change(body):
        piece = _first_piece(body)
        body["files"][name] = body["files"][piece[0]]
        piece[0] = name
        return body

    return change


def _edit_header(d: Path, old: bytes, new: bytes) -> None:
    path = d / "good" / "rank00000.safetensors"
    data = bytearray(path.read_bytes())
    (length,) = __import__("struct").unpack("<Q", data[:8])
    header = bytes(data[8 : 8 + length]).replace(old, new, 1)
    header = header[:length] if header[length:].strip() == b"" else header  # longer: eat the alignment padding
    assert len(header) == length
    data[8 : 8 + length] = header
    path.write_bytes(bytes(data))


def _header_crc(d: Path) -> int:
    data = (d / "good" / "rank00000.safetensors").read_bytes()
    (length,) = __import__("struct").unpack("<Q", data[:8])
    return zlib.crc32(data[8 : 8 + length])


def _huge_rng_resealed(d: Path) -> None:
    """The RNG tensor's header entry claims a huge shape; the header checksum in the manifest is updated."""
    _edit_header(d, b'"rng.cpu":{"dtype":"U8","shape":[', b'"rng.cpu":{"dtype":"U8","shape":[9')
    crc = _header_crc(d)

    def change(body):
        body["files"]["rank00000.safetensors"]["header_crc"] = crc
        return body

    _edit_manifest(d, change, reseal=True)


def _rewrite_rank0(d: Path, change_header) -> None:
    """Rewrite rank 0's file with an edited header (same data), and reseal everything the manifest checks: the
    file's size and header checksum, each tensor's data checksum as the new header reads it, and the manifest's own
    checksum. What is left to catch the edit is the reader's own sense."""
    import struct

    path = d / "good" / "rank00000.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    header = change_header(header)
    blob = json.dumps(header).encode() if isinstance(header, dict) else header
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)
    crcs = {}
    if isinstance(header, dict):
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                crcs[name] = zlib.crc32(body[begin:end])

    def change(manifest):
        files = manifest["files"]["rank00000.safetensors"]
        files.update(size=path.stat().st_size, header_crc=zlib.crc32(blob))
        files["crc"].update({k: v for k, v in crcs.items() if k in files["crc"]})
        return manifest

    _edit_manifest(d, change, reseal=True)


def _overlap(header: dict) -> dict:
    """The Adam moment reads the master weights' bytes (same size): one tensor silently holds another's values."""
    header["optim.exp_avg.fg0"]["data_offsets"] = list(header["master.fg0"]["data_offsets"])
    return header


def _relabel_int32(header: dict) -> dict:
    header["master.fg0"]["dtype"] = "I32"  # same bytes, read as integers: loss inf
    return header


def _deep(_header) -> bytes:
    return b"[" * 100_000 + b"]" * 100_000


def _tag_copy(d: Path) -> None:
    shutil.copytree(d / "good", d / "global_step4")
    (d / "latest").write_text("global_step4")


def _tag_link(d: Path) -> None:
    os.symlink("good", d / "global_step4")
    (d / "latest").write_text("global_step4")


def _rank_file_link(d: Path) -> None:
    """A rank file replaced by a link to an identical file elsewhere (another copy of the checkpoint)."""
    outside = d.parent / f"{d.name}-elsewhere.safetensors"
    shutil.copy(d / "good" / "rank00001.safetensors", outside)
    (d / "good" / "rank00001.safetensors").unlink()
    os.symlink(outside, d / "good" / "rank00001.safetensors")


def _client_tensor(field: str, value):
    def change(body):
        body["client_tensors"]["client.0"][field] = value
        return body

    return change


def _counter(key: str, value):
    def change(body):
        body["counters"][key] = value
        return body

    return change


def _dangling(body: dict) -> dict:
    body["client_state"]["lost"] = {"__zeroshard_tensor__": "client.9"}
    return body


def _swap_offsets(body: dict) -> dict:
    """Two parameters' pieces in the same saved tensor exchange their offsets (sizes equal, so every bound holds):
    a consistent edit, checksum recomputed."""
    seen: dict = {}
    for entry in body["params"].values():
        for piece in entry["pieces"]:
            twin = seen.get((piece[0], piece[1], piece[4]))
            if twin is not None:
                twin[2], piece[2] = piece[2], twin[2]
                return body
            seen[(piece[0], piece[1], piece[4])] = piece
    raise AssertionError("no two pieces of one size share a tensor")


# tensor-parallel split records edited (resealed): loaded at TP=2 and at TP=1, each is refused by name
def _split_edit(name: str, change):
    def edit(body):
        change(body["params"][name])
        return body

    return lambda d: _edit_manifest(d, edit, True)


def _swap_tensor_rank_files(body: dict) -> dict:
    pieces = body["params"]["transformer.h.0.mlp.c_fc.weight"]["pieces"]
    files = [p[0] for p in pieces]
    for piece, file in zip(pieces, reversed(files)):
        piece[0] = file
    return body


ATTN, FC = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"
TP_CASES = {
    "tp-dim": (_split_edit(FC, lambda e: e["split"].update(dim=0)), f"field 'params.{FC}.split'"),
    "tp-fused": (_split_edit(ATTN, lambda e: e["split"].update(fused=1)), f"field 'params.{ATTN}.split'"),
    "tp-transposed": (_split_edit(FC, lambda e: e["split"].update(transposed=False)), f"field 'params.{FC}.split'"),
    "tp-deleted": (_split_edit(FC, lambda e: e.pop("split")), f"field 'params.{FC}.split' is no split"),
    "tp-pieces-swapped": (lambda d: _edit_manifest(d, _swap_tensor_rank_files, True), "pieces moved between ranks"),
}


def _hyper(key: str, value):
    def change(body):
        body["optimizer"]["param_groups"][0][key] = value
        return body

    return change


class _Payload:
    """Unpickling this calls ``open(path, "w")``: code from the checkpoint would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled_rank_file(d: Path) -> None:
    torch.save({"weights": _Payload(str(d.parent / "PWNED"))}, d / "good" / "rank00000.safetensors")


# name -> (edit of a copy of the checkpoint directory, text the error must contain)
CASES = {
    "offset-minus-6-stale": (lambda d: _edit_manifest(d, _set(2, -6), False), "fails its checksum"),
    "offset-minus-6": (lambda d: _edit_manifest(d, _set(2, -6), True), "lies outside parameter"),
    "offset-plus-4": (lambda d: _edit_manifest(d, _set(2, lambda v: v + 4), True), "overlaps"),
    "param-offset-minus-2": (lambda d: _edit_manifest(d, _set(3, -2), True), "lies outside parameter"),
    "offset-past-tensor": (lambda d: _edit_manifest(d, _past_tensor_end, True), "requested"),
    "file-dotdot": (lambda d: _edit_manifest(d, _foreign_file("../../x.safetensors"), True), "not a plain name"),
    "file-absolute": (lambda d: _edit_manifest(d, _foreign_file("/tmp/x.safetensors"), True), "not a plain name"),
    "latest-absolute": (lambda d: (d / "latest").write_text(str(d / "good")), "not a plain name"),
    "latest-dotdot": (lambda d: (d / "latest").write_text("../good"), "not a plain name"),
    "header-dtype": (lambda d: _edit_header(d, b'"F32"', b'"I32"'), "header (names, dtypes, shapes, offsets) fails"),
    "huge-rng-shape": (_huge_rng_resealed, "bad header"),
    "no-params": (lambda d: _edit_manifest(d, lambda b: {k: v for k, v in b.items() if k != "params"}, True), "params"),
    "params-list": (lambda d: _edit_manifest(d, lambda b: {**b, "params": []}, True), "field 'params'"),
    "manifest-list": (lambda d: _manifest_path(d).write_text("[]"), "is a list"),
    "manifest-truncated": (lambda d: _manifest_path(d).write_text(_manifest_path(d).read_text()[:100]), "corrupted"),
    "bad-python-rng": (lambda d: _edit_manifest(d, lambda b: {**b, "python_rng": {"0": [1], "1": [1]}}, True), "rng"),
    "header-overlap-resealed": (lambda d: _rewrite_rank0(d, _overlap), "share bytes"),
    "header-int32-resealed": (lambda d: _rewrite_rank0(d, _relabel_int32), "is stored as int32, the manifest says"),
    "header-deep-resealed": (lambda d: _rewrite_rank0(d, _deep), "nests too deeply"),
    "manifest-deep": (lambda d: _manifest_path(d).write_text("[" * 100_000 + "]" * 100_000), "nests too deeply"),
    "manifest-deep-object": (lambda d: _manifest_path(d).write_text('{"a":' * 100_000 + "1" + "}" * 100_000), "deeply"),
    "manifest-huge-int": (lambda d: _manifest_path(d).write_text('{"format": ' + "7" * 100_000 + "}"), "4300 digits"),
    "tag-copy": (_tag_copy, "was saved as tag 'good'"),
    "tag-symlink": (_tag_link, "was saved as tag 'good'"),
    "rank-file-symlink": (_rank_file_link, "outside the checkpoint directory"),
    "client-tensor-shape": (lambda d: _edit_manifest(d, _client_tensor("shape", [3]), True), "'client.0' is stored"),
    "client-tensor-key": (lambda d: _edit_manifest(d, _client_tensor("key", "rng.cpu"), True), "'client.0' is stored"),
    "string-lr": (lambda d: _edit_manifest(d, _hyper("lr", "0.1"), True), "optimizer.param_groups[0].lr"),
    "string-betas": (lambda d: _edit_manifest(d, _hyper("betas", "0.9"), True), "optimizer.param_groups[0].betas"),
    "rank-file-pickle": (_pickled_rank_file, "truncated or corrupted"),
    "steps-huge": (lambda d: _edit_manifest(d, _counter("global_steps", 10**30), True), "counters.global_steps"),
    "steps-float": (lambda d: _edit_manifest(d, _counter("global_steps", 1e30), True), "counters.global_steps"),
    "client-dangling": (lambda d: _edit_manifest(d, _dangling, True), "refers to tensor 'client.9'"),
    "offsets-swapped": (lambda d: _edit_manifest(d, _swap_offsets, True), "offsets swapped between parameters"),
}
# cases that only a training load reads (inference reads weights, not optimizer or client state)
TRAINING_ONLY = {"client-tensor-shape", "client-tensor-key", "string-lr", "string-betas"}


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    base = tmp_path_factory.mktemp("tamper")
    run_distributed(save_worker, 2, str(base / "original"), str(base / "tp-original"))
    for name, (edit, _) in CASES.items():
        shutil.copytree(base / "original", base / name)
        edit(base / name)
    for name, (edit, _) in TP_CASES.items():
        shutil.copytree(base / "tp-original", base / name)
        edit(base / name)
    # Hugging Face directories for init_inference: an index pointing outside, and a weight of half its rows
    model = gpt2()
    model.save_pretrained(base / "hf-good", max_shard_size="20KB")
    shutil.copytree(base / "hf-good", base / "hf-index-dotdot")
    index_path = base / "hf-index-dotdot" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../hf-good/" + index["weight_map"][first]
    index_path.write_text(json.dumps(index))
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["transformer.h.0.attn.c_proj.weight"] = state["transformer.h.0.attn.c_proj.weight"][:16].clone()
    shutil.copytree(base / "hf-good", base / "hf-index-huge-int")
    (base / "hf-index-huge-int" / "model.safetensors.index.json").write_text('{"weight_map": ' + "9" * 100_000 + "}")
    (base / "hf-half-rows").mkdir()
    save_file(state, str(base / "hf-half-rows" / "model.safetensors"))
    return base


def load_everywhere(base: str, names: list[str]) -> dict:
    """Every rank tries each tampered checkpoint through load_checkpoint and init_inference; then the untouched one
    into an engine with another optimizer, and its client_state back."""
    import zeroshard
    from zeroshard.checkpoint import CheckpointError

    engine = engine_for_gpt2()
    out = {}
    for name in names:
        try:
            _, client = engine.load_checkpoint(os.path.join(base, name))
            out[("load", name)] = "loaded"
            out[("client", name)] = client
        except CheckpointError as err:
            out[("load", name)] = str(err)
        try:
            zeroshard.init_inference(
                gpt2(meta=True), tensor_parallel={"tp_size": 2}, checkpoint=os.path.join(base, name)
            )
            out[("inference", name)] = "loaded"
        except CheckpointError as err:
            out[("inference", name)] = str(err)
    sgd, *_ = zeroshard.initialize(
        model=gpt2(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 2},
        },
    )
    before = {k: v.clone() for k, v in sgd.module.state_dict().items()}
    try:
        sgd.load_checkpoint(os.path.join(base, "original"))
        out["sgd"] = "loaded"
    except CheckpointError as err:
        out["sgd"] = str(err)
    out["sgd unchanged"] = all(torch.equal(v, sgd.module.state_dict()[k]) for k, v in before.items())
    sgd.load_checkpoint(os.path.join(base, "original"), load_optimizer_states=False)
    engine.load_checkpoint(os.path.join(base, "original"))
    head = "lm_head.weight"
    out["sgd weights"] = torch.equal(sgd.module.state_dict()[head], engine.module.state_dict()[head])
    out["sgd lr"] = sgd.optimizer.param_groups[0]["lr"]
    engine.destroy()
    sgd.destroy()
    for tp in (2, 1):  # the split-record cases, at the saved degree and whole
        engine = engine_for_gpt2_tp(tp)
        for name in [*TP_CASES, "tp-original"]:
            try:
                engine.load_checkpoint(os.path.join(base, name))
                out[(f"tp{tp}", name)] = "loaded"
            except CheckpointError as err:
                out[(f"tp{tp}", name)] = str(err)
        engine.destroy()
    return out


HF_CASES = {
    "hf-index-dotdot": "not a plain name",
    "hf-half-rows": "has shape [16, 32], the model's",
    "hf-index-huge-int": "4300 digits",
}


@pytest.fixture(scope="module")
def attempts(tampered):
    return run_distributed(load_everywhere, 2, str(tampered), [*CASES, "original", *HF_CASES], timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_load_checkpoint_refuses_on_every_rank(attempts, name):
    for rank, per_rank in enumerate(attempts):
        assert CASES[name][1] in per_rank[("load", name)], (rank, per_rank[("load", name)])


@pytest.mark.parametrize("name", [name for name in CASES if name not in TRAINING_ONLY])
def test_init_inference_refuses(attempts, name):
    for per_rank in attempts:
        assert CASES[name][1] in per_rank[("inference", name)], per_rank[("inference", name)]


@pytest.mark.parametrize("name", list(TP_CASES))
@pytest.mark.parametrize("tp", [2, 1])
def test_an_edited_split_record_is_refused_at_any_tensor_parallel_degree(attempts, name, tp):
    """Re-checksummed edits of a split record once loaded other weights at TP 1 and TP 2 without a word."""
    for rank, per_rank in enumerate(attempts):
        assert TP_CASES[name][1] in per_rank[(f"tp{tp}", name)], (rank, per_rank[(f"tp{tp}", name)])
        assert per_rank[(f"tp{tp}", "tp-original")] == "loaded"


def test_no_pickle_in_a_checkpoint_ever_runs(attempts, tampered):
    assert not (tampered / "PWNED").exists()


def test_another_optimizers_state_is_refused_naming_both_and_changes_nothing(attempts):
    """An AdamW checkpoint into an SGD engine once merged AdamW's hyper-parameters silently."""
    for per_rank in attempts:
        assert "holds AdamW optimizer state, this engine's optimizer is SGD" in per_rank["sgd"], per_rank["sgd"]
        assert "load_optimizer_states=False" in per_rank["sgd"] and per_rank["sgd unchanged"]
        assert per_rank["sgd weights"] and per_rank["sgd lr"] == 0.1  # weights only: SGD keeps its own settings


def test_client_state_comes_back_exactly(attempts):
    """A user dict holding the tensor marker once came back as a tensor."""
    for per_rank in attempts:
        client = per_rank[("client", "original")]
        assert {k: v for k, v in client.items() if k != "best"} == CLIENT
        assert torch.equal(client["best"], torch.tensor([1.5, 2.5]))


@pytest.mark.parametrize("name", list(HF_CASES))
def test_init_inference_refuses_bad_hugging_face_checkpoints(attempts, name):
    for per_rank in attempts:
        assert HF_CASES[name] in per_rank[("inference", name)], per_rank[("inference", name)]


def test_the_untouched_checkpoint_loads(attempts):
    for per_rank in attempts:
        assert per_rank[("load", "original")] == "loaded" and per_rank[("inference", "original")] == "loaded"


@pytest.mark.parametrize("name", [name for name in CASES if name not in TRAINING_ONLY])
def test_convert_refuses_with_exit_code_2(tampered, tmp_path, capsys, name):
    from zeroshard.launcher.cli import main

    assert main(["convert", str(tampered / name), str(tmp_path / "out.safetensors"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard convert: ") and CASES[name][1] in err, err
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_cli_end_to_end_on_a_tampered_checkpoint(tampered, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "convert", str(tampered / "header-dtype"), str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "fails" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_convert_to_an_unwritable_output_is_a_message_not_a_traceback(tampered, tmp_path, capsys):
    from zeroshard.launcher.cli import main

    blocked = tmp_path / "file"
    blocked.write_text("a file where a directory is needed")
    assert main(["convert", str(tampered / "original"), str(blocked / "out"), "--no_progress"]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_convert_refuses_an_output_inside_the_checkpoint(tampered, tmp_path, capsys):
    """`zeroshard convert CK CK/<tag>/rank00000.safetensors` once exited 0 and destroyed the checkpoint."""
    from zeroshard.launcher.cli import main

    copy = tmp_path / "ck"
    shutil.copytree(tampered / "original", copy)
    (copy / "good2").mkdir()
    shutil.copy(copy / "good" / "manifest.json", copy / "good2" / "manifest.json")  # another checkpoint beside it
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    for output in (copy / "good" / "rank00000.safetensors", copy / "latest", copy / "good", copy, copy / "good2" / "x"):
        assert main(["convert", str(copy), str(output), "--no_progress"]) == 2
        assert "is inside the checkpoint being converted" in capsys.readouterr().err
    os.symlink(copy / "good", tmp_path / "link-into")
    assert main(["convert", str(copy), str(tmp_path / "link-into" / "x.safetensors"), "--no_progress"]) == 2
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    assert main(["convert", str(copy), str(tmp_path / "out.safetensors"), "--no_progress"]) == 0
    assert main(["convert", str(copy), str(copy / "served.safetensors"), "--no_progress"]) == 0  # beside the tags
