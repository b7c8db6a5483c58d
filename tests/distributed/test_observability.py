"""What users see: the steps_per_print line, wall-clock breakdown, comms logger, the memory breakdown
(printed once and as a dict), CSV monitor files, and a clear error for TensorBoard without its package."""

import contextlib
import csv
import io
import json
import os
import zipfile

import pytest

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))


def logging_worker(output_dir):
    import zeroshard
    from zeroshard import comm

    case = ParityCase(stage=3, lr=1e-3, clip=0.01, zero=UNITS)
    cfg = case.config()
    cfg.update(
        steps_per_print=2,
        wall_clock_breakdown=True,
        comms_logger={"enabled": True},
        csv_monitor={"enabled": True, "output_path": output_dir, "job_name": "run"},
        # both in their offline modes (WANDB_MODE=offline, Comet's online: false): nothing leaves the machine
        wandb={"enabled": True, "project": "zeroshard-test", "group": "observability"},
        comet={"enabled": True, "online": False, "project": "zeroshard-test", "samples_log_interval": 8},
    )
    engine, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    out = io.StringIO()
    rank, world = comm.get_rank(), comm.get_world_size()
    with contextlib.redirect_stdout(out):
        for x, y in make_batches(4, 2 * world):
            engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            engine.step()
        breakdown = engine.memory_breakdown()
    engine.monitor.write_events([("Custom/eval_loss", 1.25, 16)])  # a client's own event, DeepSpeed's call
    engine.destroy()  # closes the monitors: wandb finishes its offline run, Comet writes its offline archive
    sampling = {"after_report": engine.reporting.sampling_memory}
    cfg["memory_breakdown"] = True  # DeepSpeed's key: the table with every report, sampling throughout
    for monitor in ("csv_monitor", "wandb", "comet"):
        cfg.pop(monitor)
    again, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    sampling["log"] = io.StringIO()
    with contextlib.redirect_stdout(sampling["log"]):
        for x, y in make_batches(4, 2 * world):
            again.backward(again(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            again.step()
    sampling["with_memory_breakdown"], sampling["log"] = again.reporting.sampling_memory, sampling["log"].getvalue()
    sampling["delayed"] = delayed_waits(again, make_batches(2, 2 * world), rank)
    return out.getvalue(), breakdown, engine.state_bytes(), sampling


def delayed_waits(engine, batches, rank) -> dict:
    """The exposed wait of two steps, then of two more with every collective 10 ms late (the delay seam, on this
    engine's comm context): the wait grows by at least 10 ms per call."""
    import time

    def steps() -> tuple[dict, int]:
        engine.comm_ledger.reset()
        for x, y in batches:
            engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            engine.step()
        calls = {op: t.calls for (op, _), t in engine.comm_ledger.summary().items()}
        return engine.exposed_wait(), calls

    plain, calls = steps()
    engine.mesh.context.pause = lambda: time.sleep(0.01)
    try:
        late, late_calls = steps()
    finally:
        engine.mesh.context.pause = None
    return {"plain": plain, "late": late, "calls": calls, "late_calls": late_calls}


def test_logs_monitors_and_memory_breakdown(tmp_path):
    offline = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    offline["COMET_OFFLINE_DIRECTORY"] = str(tmp_path / "comet")
    results = run_distributed(logging_worker, 2, str(tmp_path), env=offline)
    log, breakdown, state, sampling = results[0]
    # samples only while a report is due; with memory_breakdown, throughout and a table with every report
    assert not sampling["after_report"] and sampling["with_memory_breakdown"]
    assert sampling["log"].count("model-state memory (MiB)") == 2
    assert results[1][0] == ""  # only rank 0 logs
    step_lines = [line for line in log.splitlines() if line.startswith("[zeroshard] step ")]
    assert len(step_lines) == 2, log
    for field in (
        "loss ",
        "lr ",
        "loss_scale ",
        "grad_norm ",
        "(clipped 0.0100)",
        "samples/s ",
        "tokens/s ",
        "skipped 0",
    ):
        assert field in step_lines[0], (field, step_lines[0])
    timing = next(line for line in log.splitlines() if line.startswith("[zeroshard] time (s)"))
    for field in ("forward", "backward", "reduce_wait", "optimizer_step", "gather_wait"):
        assert field in timing, timing
    assert "busbw GB/s" in log and "reduce_scatter" in log and "all_gather" in log
    exposed = next(line for line in log.splitlines() if line.startswith("[zeroshard] exposed wait per step: "))
    assert "% of the step" in exposed and "all_gather " in exposed and "reduce_scatter " in exposed, exposed
    assert os.path.exists(tmp_path / "run" / "Train_Samples_exposed_wait_all_gather.csv")
    delayed = sampling["delayed"]
    assert delayed["calls"] == delayed["late_calls"]
    for op, calls in delayed["calls"].items():  # each call waits 10 ms more at least (issued, then waited for)
        assert delayed["late"][op] >= delayed["plain"].get(op, 0.0) + 0.01 * calls, (op, delayed)
    assert log.count("model-state memory (MiB)") == 1  # printed once
    # the dict: every rank, start and peak; parameters at peak = this rank's parameter shard
    assert len(breakdown["start"]) == len(breakdown["peak"]) == 2
    assert breakdown["peak"][0]["parameters"] == state["params"]
    assert breakdown["peak"][0]["optimizer_state"] == state["master"] + state["optimizer_state"]
    # gather buffers are counted at the peak sample: in use (a gathered unit) or owned and idle for reuse
    assert breakdown["peak"][0]["gathered_units"] + breakdown["peak"][0]["idle_buffers"] > 0
    with open(tmp_path / "run" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"] and [int(r[0]) for r in rows[1:]] == [4, 8, 12, 16]
    assert os.path.exists(tmp_path / "run" / "Train_Samples_grad_norm.csv")
    with open(tmp_path / "run" / "Custom_eval_loss.csv") as f:
        assert list(csv.reader(f))[1:] == [["16", "1.25"]]
    # wandb: one offline run on disk (rank 0's) whose history records hold DeepSpeed's events and the client's
    (run,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = run.read_bytes()
    assert b"Train/Samples/train_loss" in records and b"Custom/eval_loss" in records and b"1.25" in records
    # Comet: one offline archive; an event name is logged again once 8 samples have passed (4 per step here)
    (archive,) = (tmp_path / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    metrics = [m["payload"]["metric"] for m in messages if m.get("type") == "metric_msg"]
    logged = [
        (m["metricName"], m["step"])
        for m in metrics
        if m["metricName"] in ("Train/Samples/train_loss", "Custom/eval_loss")
    ]
    assert logged == [("Train/Samples/train_loss", 4), ("Train/Samples/train_loss", 12), ("Custom/eval_loss", 16)]


def tensorboard_worker(output_dir):
    import zeroshard

    cfg = ParityCase(stage=1).config()
    cfg["tensorboard"] = {"enabled": True, "output_path": output_dir}
    try:
        zeroshard.initialize(model=make_model(), config=cfg)
    except ImportError as err:
        return str(err)
    return None


def test_tensorboard_without_its_package_is_a_clear_error(tmp_path):
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    message = run_distributed(tensorboard_worker, 1, str(tmp_path))[0]
    assert message is not None and "pip install tensorboard" in message


def test_memory_table_is_readable():
    from zeroshard.runtime.memory import format_table

    row = {"parameters": 2**20, "gradients": 2**21, "process_peak": 3 * 2**20}
    text = format_table({"start": [row], "peak": [row]})
    assert text.splitlines()[1].split() == [
        "phase",
        "rank",
        *"params grads optim comm_buf gathered idle_buf device host nvme proc_peak".split(),
    ]
    assert text.splitlines()[2].split()[:4] == ["start", "0", "1.00", "2.00"]
