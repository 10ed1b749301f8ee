"""Flags derived from the config dataclasses: one flag per field, types, enums, repeatable and exclusive flags."""

from __future__ import annotations

import enum
from dataclasses import fields

import pytest

from client.flags import env_name
from executor_service.config import ExecutorConfig
from executor_service.config import build_parser as executor_parser
from scheduler_service.config import SchedulerServiceConfig, parse_config
from scheduler_service.config import build_parser as scheduler_parser
from scheduler_service.core.config import CoreConfig, PreemptionMode
from scheduler_service.core.policy import Policy


@pytest.mark.parametrize("cls,parser", [(ExecutorConfig, executor_parser), (SchedulerServiceConfig, scheduler_parser)])
def test_every_field_is_a_flag_with_the_field_default(cls: type, parser: object) -> None:
    args = vars(parser().parse_args([]))  # type: ignore[operator]
    assert set(args) == {f.name for f in fields(cls)}
    defaults = cls()
    for f in fields(cls):
        want = getattr(defaults, f.name)
        if isinstance(want, list):  # a repeatable flag: unused, the field's default applies
            assert args[f.name] is None, f.name
        else:
            assert args[f.name] == (want.value if isinstance(want, enum.Enum) else want), f.name


def test_core_knobs_are_declared_once_and_reach_the_core() -> None:
    config = parse_config(["--max-num-seqs", "7", "--policy", "priority", "--preemption-mode", "swap",
                           "--no-enable-chunked-prefill", "--executor", "a:1", "--executor", "b:2"])
    core = config.core()
    assert type(core) is CoreConfig
    assert (core.max_num_seqs, core.policy, core.preemption_mode, core.enable_chunked_prefill) == (
        7, Policy.PRIORITY, PreemptionMode.SWAP, False)
    assert config.executor == ["a:1", "b:2"] and parse_config([]).executor == ["127.0.0.1:50061"]


def test_exclusive_and_typed_flags() -> None:
    config = ExecutorConfig.from_args(["--simulated", "--num-gpu-blocks", "5", "--sim-eos-rate", "0.5"])
    assert (config.simulated, config.num_gpu_blocks, config.sim_eos_rate) == (True, 5, 0.5)
    with pytest.raises(SystemExit):
        ExecutorConfig.from_args(["--simulated", "--model", "x"])
    with pytest.raises(SystemExit):
        ExecutorConfig.from_args(["--device", "tpu"])
    assert env_name("max_num_seqs") == "MAX_NUM_SEQS"
