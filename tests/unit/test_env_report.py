"""``zeroshard report``: the probes run on this machine (GPU lines say none here)."""

import json
import subprocess
import sys

import torch

from zeroshard.env_report import SHM_MINIMUM, Line, format_lines, nvme_probe, report


def test_report_covers_every_section_with_a_status():
    lines = report(probe_seconds=0.2)
    sections = {line.section for line in lines}
    assert sections == {"versions", "accelerator", "communication", "cpu", "cpu adam"}
    assert all(line.status in ("OK", "WARNING") for line in lines)
    by_name = {line.name: line for line in lines}
    assert by_name["torch"].value == torch.__version__ and by_name["gloo"].value == "available"
    if not torch.cuda.is_available():
        assert by_name["GPU"].value.startswith("none")
    assert "GB/s" in by_name["fused kernel"].value  # the probe ran
    shm = by_name["/dev/shm"]
    assert (shm.status == "WARNING") == (float(shm.value.split()[0]) * 2**20 < SHM_MINIMUM)


def test_nvme_probe_measures_a_directory(tmp_path):
    lines = {line.name: line for line in nvme_probe(str(tmp_path), nbytes=4 << 20)}
    assert lines["O_DIRECT"].value.startswith(("works", "refused"))  # tmpfs refuses it: a WARNING with the fix
    assert lines["O_DIRECT"].status == ("OK" if lines["O_DIRECT"].value == "works" else "WARNING")
    assert "GB/s" in lines["write"].value and "GB/s" in lines["read"].value
    missing = nvme_probe(str(tmp_path / "missing"))
    assert missing[0].status == "WARNING" and "existing directory" in missing[0].fix


def test_warnings_carry_their_fix_in_the_text():
    text = format_lines([Line("cpu", "/dev/shm", "64 MB", "WARNING", "run docker with --shm-size=8g")])
    assert "[WARNING] /dev/shm  64 MB  -> run docker with --shm-size=8g" in text and "1 warning(s)" in text


def test_cli_prints_json_and_text():
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "report", "--json", "--probe_seconds", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    names = {entry["name"] for entry in json.loads(out.stdout)}
    assert {"python", "torch", "zeroshard", "gloo", "cores", "fused kernel"} <= names
