"""Every DeepSpeed name that real clients (DeepSpeedExamples, transformers, accelerate, Lightning) call resolves
through `import deepspeed` in compatibility mode. Each check runs in a fresh interpreter: installing the alias
changes the process."""

import json
import subprocess
import sys
import textwrap

import pytest

# issue 13 item 2, grouped as written there
MODULE_NAMES = [
    "DeepSpeedEngine",
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "init_inference",
    "zero",
    "comm",
    "checkpointing",
    "utils.logger",
    "utils.logging.logger",
    "runtime.lr_schedules",
    "runtime.lr_schedules.VALID_LR_SCHEDULES",
    "checkpoint.utils.clone_tensors_for_torch_save",
    "utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "env_report.main",
    "env_report.cli_main",
    "ops.adam.FusedAdam",
    "ops.adam.DeepSpeedCPUAdam",
    "moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "accelerator.get_accelerator",
    "comm.barrier",
    "comm.all_reduce",
    "comm.broadcast",
    "comm.all_gather",
    "comm.get_rank",
    "comm.get_world_size",
    "comm.get_local_rank",
    "comm.is_initialized",
    "zero.Init",
    "zero.GatheredParameters",
    "zero.register_external_parameter",
    "runtime.zero.partition_parameters",
    "runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor",
    "runtime.zero.offload_config",
    "runtime.zero.offload_config.OffloadDeviceEnum",
    "runtime.zero.GatheredParameters",
    "runtime.engine.DeepSpeedEngine",
    "runtime.base_optimizer.DeepSpeedOptimizer",
    "launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
    # issue 16: DeepSpeed's model-state estimators
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold",
    # issue 28: what today's clients call
    "DeepSpeedConfigError",
    *(
        f"utils.{name}"
        for name in (
            "set_z3_leaf_modules",
            "unset_z3_leaf_modules",
            "get_z3_leaf_modules",
            "z3_leaf_module",
            "set_z3_leaf_module",
            "set_z3_leaf_modules_by_name",
            "set_z3_leaf_modules_by_suffix",
        )
    ),
    "runtime.config.DeepSpeedConfigError",
    *(
        f"comm.{name}"
        for name in (
            "reduce",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "all_gather_into_tensor",
            "all_to_all",
            "all_to_all_single",
            "gather",
            "scatter",
            "send",
            "recv",
            "isend",
            "irecv",
            "monitored_barrier",
            "get_all_ranks_from_group",
            "get_global_rank",
            "new_group",
        )
    ),
]
ACCELERATOR_METHODS = [
    "is_available",
    "device_name",
    "current_device_name",
    "memory_allocated",
    "max_memory_allocated",
    "synchronize",
    "is_bf16_supported",
    "is_fp16_supported",
    "communication_backend_name",
]
# on the class (instance attributes such as engine.device and engine.module are checked on a live engine in
# tests/distributed/test_compat.py)
ENGINE_NAMES = [
    "local_rank",
    "config",
    "optimizer",
    "set_gradient_accumulation_boundary",
    "no_sync",
    "zero_gather_16bit_weights_on_model_save",
    "_zero3_consolidated_16bit_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "destroy",
    "backward",
    "step",
    "get_global_grad_norm",
    "compile",
    "is_compiled",
    "empty_partition_cache",
]
OPTIMIZER_NAMES = ["state_dict", "load_state_dict", "loss_scale", "cur_scale", "param_groups", "state", "zero_grad"]


def run(code: str, env_flag: bool = False, extra_path: str = "") -> dict:
    import os

    env = dict(os.environ)
    env.pop("ZEROSHARD_AS_DEEPSPEED", None)
    if env_flag:
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_name_clients_call_is_present():
    found = run(
        f"""
        import importlib, json, zeroshard
        zeroshard.install_as_deepspeed()
        import deepspeed
        missing = []
        for dotted in {MODULE_NAMES!r}:
            parts = dotted.split(".")
            try:
                obj = importlib.import_module("deepspeed." + ".".join(parts[:-1])) if len(parts) > 1 else deepspeed
                for part in parts[len(parts) - 1:] if len(parts) > 1 else parts:
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as err:
                missing.append(f"{{dotted}}: {{err}}")
        acc = deepspeed.accelerator.get_accelerator()
        missing += [m for m in {ACCELERATOR_METHODS!r} if not callable(getattr(acc, m, None))]
        missing += [n for n in {ENGINE_NAMES!r} if not hasattr(deepspeed.DeepSpeedEngine, n)]
        optimizer = deepspeed.runtime.base_optimizer.DeepSpeedOptimizer
        missing += [n for n in {OPTIMIZER_NAMES!r} if not hasattr(optimizer, n)]
        print(json.dumps({{"missing": missing}}))
        """
    )
    assert found["missing"] == []


def test_alias_is_explicit_and_reports_the_api_version():
    found = run(
        """
        import importlib.metadata, importlib.util, json
        before = importlib.util.find_spec("deepspeed") is not None
        import zeroshard
        after_import = importlib.util.find_spec("deepspeed") is not None
        zeroshard.install_as_deepspeed()
        import deepspeed, deepspeed.runtime.zero.partition_parameters as pp
        import zeroshard.compat.deepspeed as namespace
        print(json.dumps({
            "before": before, "after_import": after_import,
            "version": deepspeed.__version__, "metadata": importlib.metadata.version("deepspeed"),
            "truth": deepspeed.__zeroshard_version__,
            "same": deepspeed is namespace and pp is namespace.runtime.zero.partition_parameters,
            "spec": deepspeed.__spec__.name,
        }))
        """
    )
    assert not found["before"] and not found["after_import"]  # nothing is shadowed unless asked
    assert found["version"] == found["metadata"] and found["version"].startswith("0.19.")
    assert found["truth"] == __import__("zeroshard").__version__
    assert found["same"] and found["spec"] == "zeroshard.compat.deepspeed"


def test_environment_variable_installs_at_interpreter_start():
    found = run(
        """
        import json, sys
        already = "zeroshard" in sys.modules  # the .pth hook imported it
        import deepspeed
        print(json.dumps({"already": already, "file": deepspeed.__file__}))
        """,
        env_flag=True,
    )
    assert found["already"] and found["file"].endswith("zeroshard/compat/deepspeed/__init__.py")


def test_an_installed_deepspeed_is_shadowed_with_a_warning(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    found = run(
        """
        import json, warnings, zeroshard
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeroshard.install_as_deepspeed()
        import deepspeed
        print(json.dumps({"real": hasattr(deepspeed, "REAL"), "warnings": [str(w.message) for w in caught]}))
        """,
        extra_path=str(tmp_path),
    )
    assert not found["real"]
    assert len(found["warnings"]) == 1 and "is shadowed" in found["warnings"][0]


def test_installing_after_deepspeed_was_imported_is_refused(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    found = run(
        """
        import json, deepspeed, zeroshard
        try:
            zeroshard.install_as_deepspeed()
            print(json.dumps({"error": None}))
        except RuntimeError as err:
            print(json.dumps({"error": str(err)}))
        """,
        extra_path=str(tmp_path),
    )
    assert "already imported" in found["error"]


def test_moe_split_is_the_identity_without_experts():
    from zeroshard.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    a, b = object(), object()
    assert split({"params": [a, b], "name": "x"}) == [{"params": [a, b], "name": "x"}]
    assert split(({"params": [a]}, {"params": [b], "lr": 1})) == [{"params": [a]}, {"params": [b], "lr": 1}]


@pytest.mark.parametrize(
    "value, enabled",
    [("1", True), ("TRUE", True), (" yes ", True), ("false", False), ("no", False), (" ", False), ("off", False)],
)
def test_the_environment_switch_takes_only_clear_words(value, enabled):
    """ZEROSHARD_AS_DEEPSPEED=false / no / " " once enabled compat mode (anything but "" and "0" did)."""
    import os

    env = {**os.environ, "ZEROSHARD_AS_DEEPSPEED": value}
    code = "import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == str(enabled) and out.stderr == "", out


def test_an_unknown_switch_value_is_named_and_leaves_compat_mode_off():
    import os

    env = {**os.environ, "ZEROSHARD_AS_DEEPSPEED": "maybe"}
    code = "import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False"
    assert "ZEROSHARD_AS_DEEPSPEED='maybe' is not a switch zeroshard knows" in out.stderr


def test_init_distributed_without_a_group_and_without_permission_to_create_one_is_named():
    found = run(
        """
        import json, zeroshard
        zeroshard.install_as_deepspeed()
        import deepspeed
        try:
            deepspeed.init_distributed(dist_init_required=False)
            print(json.dumps({"error": None}))
        except RuntimeError as err:
            print(json.dumps({"error": str(err), "group": deepspeed.comm.is_initialized()}))
        """
    )
    assert "dist_init_required=False): no process group exists" in found["error"] and found["group"] is False
