"""The role command line from the environment (zserve.runtime.args): what a container's
``ZSERVE_*`` variables give a role started alone, and the flags a pod needs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from zserve.runtime.args import env_name, instance_index, role_config_from_args, role_parser

CLUSTER_TOML = """
[cluster]
transport = "tcp"
[scheduler]
standby = true
rank_address = "tcp://zserve-scheduler-a:7100"
shard_addresses = ["tcp://zserve-scheduler-a:7200"]
standby_rank_address = "tcp://zserve-scheduler-b:7100"
standby_shard_address = "tcp://zserve-scheduler-b:7200"
[[models]]
name = "m"
emulated = { alpha_ms = 1.0, beta_ms = 2.0 }
"""


@pytest.fixture
def cluster_file(tmp_path: Path) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return str(path)


def parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = role_parser("zserve test", None, environ=environ)
    parser.add_argument("--bind")
    parser.add_argument("--shard", action="append", default=[])
    parser.add_argument("--standby", action=argparse.BooleanOptionalAction, default=False)
    return parser


def test_every_flag_comes_from_its_variable_and_the_command_line_wins(cluster_file: str) -> None:
    environ = {"ZSERVE_CONFIG": cluster_file, "ZSERVE_INDEX": "zserve-backend-3",
               "ZSERVE_RANK": "tcp://10.0.0.1:7100", "ZSERVE_BIND": "tcp://0.0.0.0:7300",
               "ZSERVE_SHARD": "tcp://a:7200, tcp://b:7200", "ZSERVE_STANDBY": "true",
               "ZSERVE_ADVERTISE": "10.0.0.9"}
    args = parser(environ).parse_args([])  # --config is required, and given by ZSERVE_CONFIG
    assert (args.config, args.index, args.rank, args.bind) == (
        cluster_file, 3, "tcp://10.0.0.1:7100", "tcp://0.0.0.0:7300")
    assert args.shard == ["tcp://a:7200", "tcp://b:7200"] and args.standby is True
    args = parser(environ).parse_args(["--index", "1", "--bind", "tcp://127.0.0.1:9",
                                       "--no-standby"])
    assert (args.index, args.bind, args.standby) == (1, "tcp://127.0.0.1:9", False)
    assert parser({**environ, "ZSERVE_STANDBY": "0"}).parse_args([]).standby is False
    config = role_config_from_args(parser(environ).parse_args([]), "backend")
    assert config.name == "backend-3" and config.advertise_host == "10.0.0.9"
    assert config.peers["rank/rank"] == "tcp://10.0.0.1:7100"


def test_without_variables_the_flags_are_as_before(cluster_file: str) -> None:
    args = parser({}).parse_args(["--config", cluster_file])
    assert (args.index, args.rank, args.bind, args.shard, args.standby) == (
        0, None, None, [], False)
    with pytest.raises(SystemExit):  # --config is still required
        parser({}).parse_args([])


def test_an_index_is_a_number_or_a_pod_name_ending_in_one() -> None:
    assert instance_index("7") == 7
    assert instance_index("zserve-frontend-12") == 12
    for bad in ("zserve-frontend", "", "-", "3a"):
        with pytest.raises(argparse.ArgumentTypeError, match="not an index"):
            instance_index(bad)
    with pytest.raises(SystemExit):
        parser({"ZSERVE_INDEX": "zserve-frontend"}).parse_args(["--config", "x"])
    assert env_name("--rank-bind") == "ZSERVE_RANK_BIND"


def test_the_standby_scheduler_alone_takes_its_name_and_addresses(cluster_file: str) -> None:
    args = parser({"ZSERVE_CONFIG": cluster_file}).parse_args([])
    config = role_config_from_args(args, "shard", "shard-0b")
    assert config.name == "shard-0b" and config.standby and config.embedded_rank
    assert config.bind == {"shard": "tcp://zserve-scheduler-b:7200",
                           "rank": "tcp://zserve-scheduler-b:7100"}
    assert config.peers["shard-0/rank"] == "tcp://zserve-scheduler-a:7100"
