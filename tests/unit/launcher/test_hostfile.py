import pytest

from zeroshard.launcher.hostfile import parse_filter, parse_hostfile, select_resources

HOSTFILE = """
# two workers
worker-0 slots=4
worker-1 slots=2   # the small one

"""


def test_hostfile_lines_comments_and_blank_lines():
    assert parse_hostfile(HOSTFILE) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}


@pytest.mark.parametrize(
    "text, message",
    [
        ("worker-0 slots=4\nworker-0 slots=2", "hosts:2: host 'worker-0' is listed twice"),
        ("worker-0 slots=4\nworker-1 gpus=2", "hosts:2: 'worker-1 gpus=2' is not 'HOST slots=N'"),
        ("worker-0 slots=0", "hosts:1: host 'worker-0' has slots=0"),
        ("# nothing\n\n", "hosts: no hosts"),
    ],
)
def test_bad_hostfile_names_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text, "hosts")


def test_include_exclude_and_counts_choose_hosts_and_slots():
    hosts = parse_hostfile(HOSTFILE)
    assert select_resources(hosts, include="worker-0:0,1@worker-1") == {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert select_resources(hosts, include="worker-1") == {"worker-1": [0, 1]}
    assert select_resources(hosts, exclude="worker-0:3@worker-1") == {"worker-0": [0, 1, 2]}
    assert select_resources(hosts, num_nodes=1) == {"worker-0": [0, 1, 2, 3]}
    assert select_resources(hosts, num_gpus=2) == {"worker-0": [0, 1], "worker-1": [0, 1]}
    assert select_resources(hosts) == hosts


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"include": "worker-9"}, "--include 'worker-9': unknown host 'worker-9'"),
        ({"include": "worker-1:2"}, "slot 2 of host 'worker-1' is out of range"),
        ({"exclude": "worker-0:x"}, "slots of 'worker-0' must be integers"),
        ({"include": "worker-0", "exclude": "worker-1"}, "cannot be used together"),
        ({"include": "worker-0", "num_gpus": 1}, "drop --num_nodes/--num_gpus"),
        ({"num_gpus": 3}, r"--num_gpus 3 is more than the slots of worker-1 \(slots=2\)"),
        ({"num_nodes": 3}, "--num_nodes 3: the hostfile has 2 host"),
        ({"exclude": "worker-0@worker-1"}, "leaves no slot"),
    ],
)
def test_bad_filters_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_resources(parse_hostfile(HOSTFILE), **kwargs)


def test_filter_keeps_slot_order_without_duplicates():
    assert parse_filter("worker-0:2,0,2", parse_hostfile(HOSTFILE), "--include") == {"worker-0": [2, 0]}


@pytest.mark.parametrize(
    "host", ["-oProxyCommand=touch${IFS}x", "a,b", "h;id", "h$(id)", "h`id`", "h|x", "a:b", "u@h", "h'", "h&"]
)
def test_host_names_that_reach_a_shell_or_ssh_options_are_refused_naming_the_line(host):
    with pytest.raises(ValueError, match=r"hosts:2: host .* is not a plain host name"):
        parse_hostfile(f"worker-0 slots=1\n{host} slots=1\n", "hosts")


def test_absurd_slot_counts_and_empty_filters_are_named():
    with pytest.raises(ValueError, match="hosts:1: host 'w' has slots=4000000000; at most 4096"):
        parse_hostfile("w slots=4000000000", "hosts")
    hosts = parse_hostfile("worker-0 slots=2\nworker-1 slots=2")
    for flag in ("include", "exclude"):
        with pytest.raises(ValueError, match=f"--{flag} is empty"):
            select_resources(hosts, **{flag: " "})
    assert parse_hostfile("node_1.cluster-a slots=1") == {"node_1.cluster-a": [0]}


@pytest.mark.parametrize(
    "argv",
    [
        "--num_nodes 1 -i localhost foo.py",
        "--num_nodes 1 --num_gpus 1 -i localhost foo.py",
        "--num_gpus 1 -i localhost foo.py",
        "--num_nodes 1 -e localhost foo.py",
        "--num_gpus 1 -e localhost foo.py",
    ],
)
def test_include_or_exclude_with_counts_is_refused_without_a_hostfile_too(argv, tmp_path, monkeypatch):
    """DeepSpeed's rule (its launcher test_num_plus_parser): the zeroshard CLI stops with the flags named, the compat
    runner raises DeepSpeed's ValueError; neither starts the script (it would create a marker file)."""
    from zeroshard.compat.deepspeed.launcher import runner
    from zeroshard.launcher.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "foo.py").write_text("open('ran', 'w').close()\n")
    with pytest.raises(SystemExit, match="--include/--exclude choose the hosts and slots; drop --num_nodes/--num_gpus"):
        main(argv.split())
    with pytest.raises(ValueError, match="drop --num_nodes/--num_gpus"):
        runner.main(argv.split())
    assert not (tmp_path / "ran").exists()


def test_deepspeeds_resource_filter_and_hostfile_reader():
    from zeroshard.compat.deepspeed.launcher import runner

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert runner.parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {
        "worker-0": [2, 3],
        "worker-1": [0, 1, 2],
    }
    assert runner.parse_resource_filter({"worker-0": [0, 1]}, exclude_str="worker-0") == {}  # empty, not an error
    assert runner._parse_hostfile(["worker-1 slots=2", "# a comment", "", "localhost slots=1"]) == {
        "worker-1": 2,
        "localhost": 1,
    }
    with pytest.raises(ValueError, match="listed twice"):
        runner._parse_hostfile(["worker-1 slots=2", "worker-1 slots=1"])
