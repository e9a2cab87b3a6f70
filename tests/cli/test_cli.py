"""The ``strop`` command line: shared options anywhere, complete ``--help``, the dataset checked before a model
loads, help texts true on a CPU, and replayed rates shown as recorded."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace as N

import pytest

from strop.cli.main import build_parser, main
from strop.cli.options import DEFAULT_EXPORT, DEFAULT_TRAINER, target_of
from strop.client.progress import follow

COMMANDS = {  # a command line without --target, and the service it calls by default
    "train": (["train", "--model", "m", "--dataset", "d.jsonl"], DEFAULT_TRAINER),
    "jobs": (["jobs", "watch", "job-1"], DEFAULT_TRAINER),
    "sessions": (["sessions", "list"], DEFAULT_TRAINER),
    "export run": (["export", "run", "--to", "merged"], DEFAULT_EXPORT),
    "export list": (["export", "list"], DEFAULT_EXPORT),
}


def _positions(argv: list[str]) -> list[list[str]]:
    """``--target`` first, after the command, and last (after the subcommand and its arguments)."""
    t = ["--target", "host:9"]
    return [t + argv, argv[:1] + t + argv[1:], argv + t]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_target_goes_before_or_after_the_subcommand_alike(command):
    argv, default = COMMANDS[command]
    parser = build_parser()
    assert target_of(parser.parse_args(argv), default) == default, (
        "no --target: the command's default service"
    )
    for line in _positions(argv):
        assert target_of(parser.parse_args(line), default) == "host:9", f"strop {' '.join(line)}"


def _parsers(parser: argparse.ArgumentParser, path: str = "strop"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"{path} {name} has no one-line help in {path} --help"
                yield from _parsers(sub, f"{path} {name}")


def test_every_subcommand_help_describes_every_subcommand_and_option():
    seen = []
    for path, parser in _parsers(build_parser()):
        seen.append(path)
        if path == "strop serve":
            continue  # `strop serve trainer|export --help` is the server's own parser
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{path}: {'/'.join(action.option_strings) or action.dest} has no help"
    for cmd in (
        "jobs list",
        "jobs get",
        "jobs watch",
        "jobs cancel",
        "jobs plot",
        "sessions list",
        "sessions close",
    ):
        assert f"strop {cmd}" in seen


def test_jobs_help_lists_each_subcommand_with_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["jobs", "--help"])
    out = capsys.readouterr().out
    for name, words in (
        ("list", "one line per job"),
        ("get", "as JSON"),
        ("watch", "replay the job's events"),
        ("cancel", "stops between steps"),
        ("plot", "loss curve"),
    ):
        assert re.search(rf"^\s+{name}\s+.*{re.escape(words)}", out, re.M), f"{name}: {out}"


def test_quantization_help_says_what_auto_does_on_this_cpu_too(client):
    from strop.client import Quantization

    train = dict(_parsers(build_parser()))["strop train"]
    text = next(a.help for a in train._actions if "--quantization" in a.option_strings)
    assert "on a GPU" not in text and "the CPU included" in text, text
    s = client.load_model("tiny-llama", quantization=Quantization.UNSPECIFIED)
    try:
        assert s.facts.device == "cpu" and s.facts.quantization == "bnb-nf4-on-load", (
            "auto quantizes a 16-bit checkpoint to NF4 on the CPU, as the help says"
        )
    finally:
        client.close_session(s.session_id)


def test_train_checks_the_dataset_before_it_loads_a_model(client, trainer, tmp_path, capsys):
    running, _, _ = trainer
    target = ["--target", f"127.0.0.1:{running.port}"]
    before = len(client.list_sessions(include_closed=True))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    assert main(["train", "--model", "tiny-llama", "--dataset", str(bad), *target]) == 1
    assert "line 2" in capsys.readouterr().err, "the trainer names the bad line"
    assert (
        main(["train", "--model", "tiny-llama", "--dataset", str(tmp_path / "missing.jsonl"), *target]) == 2
    )
    messages = tmp_path / "sft.jsonl"
    messages.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    )
    assert (
        main(["train", "--method", "dpo", "--model", "tiny-llama", "--dataset", str(messages), *target]) == 2
    )
    assert "DPO trains on preference rows; this dataset is messages" in capsys.readouterr().err
    assert len(client.list_sessions(include_closed=True)) == before, "no model was loaded for a bad dataset"


def test_a_replayed_job_shows_the_rate_it_trained_at_not_the_rate_it_was_replayed_at(capsys):
    def replay(n: int, seconds_per_step: float):
        for i in range(1, n + 1):  # recorded 2 s apart, delivered at once
            step = N(step=i, total_steps=n, loss=1.0, learning_rate=1e-3, tokens_per_second=100.0, dpo=None)
            yield N(
                job_id="job",
                time=1000.0 + i * seconds_per_step,
                step=step,
                state=None,
                checkpoint=None,
                adapter=None,
                log=None,
            )

    follow(replay(200, 2.0))
    rates = [float(r) for r in re.findall(r"([\d.]+)step/s", capsys.readouterr().err)]
    assert rates, "the bar shows a rate"
    assert all(abs(r - 0.5) < 1e-3 for r in rates), f"recorded 0.5 step/s, shown {sorted(set(rates))}"


def test_serve_help_says_where_each_servers_options_are(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "strop serve trainer --help" in out and "strop serve export --help" in out


def test_adapter_scale_takes_a_number_or_auto_and_refuses_anything_else(capsys):
    from strop.common.trainer_types import ADAPTER_SCALE_AUTO

    parser = build_parser()
    base = ["train", "--model", "m", "--dataset", "d.jsonl"]
    assert parser.parse_args([*base, "--adapter-scale", "auto"]).adapter_scale == ADAPTER_SCALE_AUTO
    assert parser.parse_args([*base, "--adapter-scale", "AUTO"]).adapter_scale == ADAPTER_SCALE_AUTO
    assert parser.parse_args([*base, "--adapter-scale", "0.7"]).adapter_scale == 0.7
    assert parser.parse_args(base).adapter_scale == 0.0, "0: the default (auto under the chat recipe)"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--adapter-scale", "most"])
    assert "a number in 0..1 or auto, not 'most'" in capsys.readouterr().err
