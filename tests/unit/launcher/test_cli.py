import sys

import pytest

from zeroshard.launcher.cli import build_parser, torchrun_command


def command(*argv):
    return torchrun_command(build_parser().parse_args(list(argv)))


def test_builds_torchrun_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cmd = command("--num_gpus", "2", str(script), "--deepspeed_config", "ds.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--standalone" in cmd
    assert cmd[-3:] == [str(script), "--deepspeed_config", "ds.json"]
    cmd = command("--nproc_per_node", "4", "--master_port", "29511", str(script))
    assert "--master_port=29511" in cmd and "--standalone" not in cmd and "--nproc_per_node=4" in cmd


def test_bad_invocations_exit_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        command("--num_gpus", "2", str(tmp_path / "missing.py"))
    with pytest.raises(SystemExit, match="must be >= 1"):
        command("--num_gpus", "0", str(tmp_path / "x.py"))
    with pytest.raises(SystemExit, match="multi-node"):
        command("--num_nodes", "2", str(tmp_path / "x.py"))


def test_process_count_against_gpus_and_cores():
    from zeroshard.launcher.cli import check_process_count

    with pytest.raises(SystemExit, match=r"--num_gpus 4 but this machine has 2 GPU\(s\)"):
        check_process_count(4, gpus=2, cores=64)
    assert check_process_count(2, gpus=2, cores=1) is None
    assert check_process_count(2, gpus=0, cores=2) is None
    warning = check_process_count(16, gpus=0, cores=2)
    assert "16 CPU ranks on 2 core(s)" in warning and "8.0x slower" in warning


def test_gpu_count_needs_no_torch_where_no_gpu_driver_is_present(tmp_path):
    """No GPU driver on a Linux machine: 0 GPUs, known without importing torch (2-3 s per launch); with a driver
    present the count is torch's."""
    import subprocess
    import sys

    missing = [str(tmp_path / "no-driver")]
    code = (
        "import sys; from zeroshard.launcher.cli import gpu_count; "
        f"print(gpu_count({missing!r}), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if sys.platform.startswith("linux"):
        assert out.stdout.split() == ["0", "False"]

    import torch

    from zeroshard.launcher.cli import gpu_count

    assert gpu_count([str(tmp_path)]) == torch.cuda.device_count()  # a driver path exists: torch counts


def test_as_deepspeed_runs_every_rank_through_the_compat_runner(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cmd = command("--as_deepspeed", "--num_gpus", "2", str(script), "--deepspeed", "ds.json")
    assert cmd[-5:] == ["--module", "zeroshard.compat.run", str(script), "--deepspeed", "ds.json"]
    module = command("--as_deepspeed", "--module", "--num_gpus", "2", "pkg.train")
    assert module[-4:] == ["--module", "zeroshard.compat.run", "-m", "pkg.train"]


def test_hostfile_errors_exit_naming_the_line_or_flag(tmp_path, monkeypatch):
    from zeroshard.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    with pytest.raises(SystemExit, match="--include 'worker-7': unknown host 'worker-7'"):
        main(["--hostfile", str(hosts), "--include", "worker-7", str(script)])
    with pytest.raises(SystemExit, match="cannot read --hostfile"):
        main(["--hostfile", str(tmp_path / "missing"), str(script)])
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh (nor anything else) on PATH
    with pytest.raises(SystemExit, match="--launcher pdsh needs 'pdsh' on PATH"):
        main(["--hostfile", str(hosts), "--launcher", "pdsh", str(script)])
    with pytest.raises(SystemExit, match="--no_ssh starts one node of a job: give its --node_rank"):
        main(["--no_ssh", str(script)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no_ssh", "--node_rank", "-1"], "--node_rank: must be >= 0, got -1"),
        (["--master_port", "0"], "--master_port: must be 1-65535, got 0"),
        (["--master_port", "70000"], "--master_port: must be 1-65535, got 70000"),
        (["--max_restarts", "-1"], "--max_restarts: must be >= 0, got -1"),
        (["--ssh_port", "x"], "--ssh_port: expected an integer, got 'x'"),
        (["--rdzv_conf", "last_call_timeout=;rm"], "--rdzv-conf: last_call_timeout=';rm' is not a whole number"),
        (["--rdzv_conf", "is_host=true"], "--rdzv_conf/--rdzv-conf: unknown option 'is_host'"),
    ],
)
def test_out_of_range_flags_exit_2_naming_the_flag(tmp_path, capsys, argv, message):
    from zeroshard.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, str(script)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_rendezvous_options_on_one_node_alone_are_refused(tmp_path):
    from zeroshard.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit, match="--rdzv_conf sets a multi-node job's rendezvous"):
        main(["--num_gpus", "1", "--rdzv_conf", "last_call_timeout=5", str(script)])


def test_node_rank_beyond_the_node_count_is_refused(tmp_path):
    from zeroshard.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit, match=r"--node_rank 2 but the job has at most 2 node\(s\)"):
        main(["--no_ssh", "--node_rank", "2", "--num_nodes", "2", str(script)])
    with pytest.raises(SystemExit, match=r"--node_rank 4 but the job has at most 4 node\(s\) \(--nnodes 1:4\)"):
        main(["--no_ssh", "--node_rank", "4", "--nnodes", "1:4", str(script)])
    with pytest.raises(SystemExit, match="--nnodes '3:1': expected 1 <= MIN <= MAX"):
        main(["--no_ssh", "--node_rank", "0", "--nnodes", "3:1", str(script)])


def test_hostile_hostfile_and_empty_include_exit_naming_them(tmp_path):
    from zeroshard.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\n-oProxyCommand=sh slots=1\n")
    with pytest.raises(SystemExit, match=r"hosts:2: host '-oProxyCommand=sh' is not a plain host name"):
        main(["--hostfile", str(hosts), str(script)])
    hosts.write_text("worker-0 slots=2\n")
    with pytest.raises(SystemExit, match="--include is empty"):
        main(["--hostfile", str(hosts), "--include", "", str(script)])
