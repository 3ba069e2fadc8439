"""The accelerate configs in examples/accelerate: accelerate's own loader reads each with the fields the guide
promises; `accelerate launch` takes the command written at the top of each file (a --num_processes given there beats
the file's, and the multi-node flags of the guide give one launcher per machine); the FSDP2 config wraps every
decoder layer through the model's `_no_split_modules`; the guide's "Beyond one GPU" section and the folder's README
name every file. Nothing is launched: the tests stop where accelerate would start the processes."""

import re
import shlex
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

from slimrl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "examples" / "accelerate"

# file -> (distributed type, processes in the file, accelerate launch's flag for that type)
EXPECTED = {
    "ddp.yaml": (DistributedType.MULTI_GPU, 2, "multi_gpu"),
    "fsdp2.yaml": (DistributedType.FSDP, 2, "use_fsdp"),
    "zero3.yaml": (DistributedType.DEEPSPEED, 2, "use_deepspeed"),
    "rollout_device.yaml": (DistributedType.NO, 1, None),
}
LAUNCH_FLAGS = ("multi_gpu", "use_fsdp", "use_deepspeed")


def config_path(name: str) -> Path:
    return CONFIG_DIR / name


def launch_line(name: str) -> list[str]:
    """The launch command written in the file's header comment, split as a shell would."""
    header = [line for line in config_path(name).read_text().splitlines() if line.startswith("#")]
    commands = [line.lstrip("# ") for line in header if line.lstrip("# ").startswith("accelerate launch ")]
    assert len(commands) == 1, f"{name}: expected one `accelerate launch` line in the header, found {commands}"
    return shlex.split(commands[0])


def validated_launch(arguments: list[str]):
    """accelerate launch's arguments after it has merged in the config file (what it would start processes with)."""
    args = launch_command_parser().parse_args(arguments)
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def guide_section() -> str:
    text = (ROOT / "docs" / "guide.md").read_text()
    match = re.search(r"^## Beyond one GPU\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match is not None, 'docs/guide.md has no "## Beyond one GPU" section'
    return match.group(1)


def test_every_config_file_is_specified_here():
    assert sorted(path.name for path in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_loads_the_config(name):
    distributed_type, processes, _ = EXPECTED[name]
    config = load_config_from_file(str(config_path(name)))
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == distributed_type
    assert config.num_processes == processes
    assert config.mixed_precision == "bf16"
    assert (config.num_machines, config.machine_rank) == (1, 0)
    assert config.gpu_ids == "all"  # rollout_device.yaml: a narrower list would hide the rollout GPU
    assert config.use_cpu is False
    if distributed_type != DistributedType.FSDP:
        assert config.fsdp_config == {}
    if distributed_type != DistributedType.DEEPSPEED:
        assert config.deepspeed_config == {}


def test_fsdp2_config_shards_by_layer_class_and_leaves_checkpointing_to_slimrl():
    config = load_config_from_file(str(config_path("fsdp2.yaml")))
    assert config.fsdp_config == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # no layer class named: the model's _no_split_modules
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
        "fsdp_offload_params": False,
    }


def test_zero3_config_shards_everything_and_offloads_nothing():
    config = load_config_from_file(str(config_path("zero3.yaml")))
    assert config.deepspeed_config == {
        "zero_stage": 3,
        "zero3_init_flag": True,
        "zero3_save_16bit_model": True,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "deepspeed_multinode_launcher": "standard",  # the same command on every machine, no pdsh
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_commented_launch_command_runs_the_demo_with_this_file(name, monkeypatch):
    distributed_type, processes, flag = EXPECTED[name]
    words = launch_line(name)
    assert words[:4] == ["accelerate", "launch", "--config_file", f"examples/accelerate/{name}"]
    monkeypatch.chdir(ROOT)
    args, defaults = validated_launch(words[2:])
    assert defaults.distributed_type == distributed_type
    assert {f: bool(getattr(args, f)) for f in LAUNCH_FLAGS} == {f: f == flag for f in LAUNCH_FLAGS}
    assert args.num_processes == processes
    assert args.mixed_precision == "bf16"
    assert args.module and args.training_script == "slimrl.cli"
    demo = build_parser().parse_args(args.training_script_args)  # only arguments the demo has
    assert (demo.command, demo.steps) == ("demo", 40)


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp2.yaml", "zero3.yaml"])
def test_num_processes_on_the_command_line_beats_the_file(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    args, _ = validated_launch(["--config_file", f"examples/accelerate/{name}", "--num_processes", "8", "train.py"])
    assert args.num_processes == 8


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp2.yaml", "zero3.yaml"])
def test_multi_node_flags_give_each_machine_its_share_and_the_main_address(name, monkeypatch):
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.chdir(ROOT)
    args, defaults = validated_launch(
        ["--config_file", f"examples/accelerate/{name}", "--num_processes", "8", "--num_machines", "2",
         "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "train.py"]
    )  # fmt: skip
    if defaults.distributed_type == DistributedType.DEEPSPEED:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        command, _ = prepare_deepspeed_cmd_env(args)
        assert command is None  # torchrun on each machine, not DeepSpeed's ssh launcher from the first
    else:
        prepare_multi_gpu_env(args)
    # --num_processes counts every machine's processes
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "4")
    # torchrun's rendezvous point (accelerate passes it as --rdzv_endpoint, or as --master_addr/--master_port when the
    # command line asks for --same_network)
    endpoint = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
    assert endpoint == "10.0.0.1:29500"


def test_fsdp2_launch_wraps_each_decoder_layer_by_no_split_modules(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env

    from slimrl import FastLanguageModel
    from slimrl.testing import tiny_model

    monkeypatch.chdir(ROOT)
    args, _ = validated_launch(["--config_file", "examples/accelerate/fsdp2.yaml", "--main_process_port", "0", "x.py"])
    for key, value in prepare_multi_gpu_env(args).items():  # what the launched processes would see
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap is None and plugin.activation_checkpointing is False
    model = FastLanguageModel.get_peft_model(tiny_model("llama"), r=4, lora_alpha=8, use_gradient_checkpointing=False)
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [name for name, module in model.named_modules() if wrap(module)]
    assert wrapped == [f"base_model.model.model.layers.{i}" for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("document", ["guide", "README"])
def test_the_docs_name_every_config_file(document):
    if document == "guide":
        text = guide_section()
    else:
        text = (CONFIG_DIR / "README.md").read_text()
    configs = sorted(path.name for path in CONFIG_DIR.glob("*.yaml"))
    assert configs, "no configs found"
    missing = [name for name in configs if f"examples/accelerate/{name}" not in text]
    assert not missing, f"{document} does not name {missing}"
