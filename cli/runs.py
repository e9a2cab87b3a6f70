"""``strop runs list|show|delete``: the step API's training runs on a trainer."""

from __future__ import annotations

import datetime

from strop.cli.options import DEFAULT_TRAINER, add_target, target_of
from strop.cli.output import print_json


def register(sub) -> None:
    p = sub.add_parser(
        "runs",
        help="list, show or delete training runs (the step API)",
        description="Training runs (a LoRA adapter + optimizer state on a loaded session): list, show, delete.",
    )
    add_target(p, "trainer")
    rsub = p.add_subparsers(dest="runs_cmd", required=True, metavar="{list,show,delete}")
    q = rsub.add_parser(
        "list", help="one line per run: id, owner, session, rank, steps, pending, last activity"
    )
    q.add_argument("--session", default="", help="only this session's runs")
    add_target(q, "trainer")
    for name, what in (
        ("show", "the run's details as JSON"),
        ("delete", "delete the run (its pending futures end)"),
    ):
        q = rsub.add_parser(name, help=what)
        q.add_argument("run_id", help="the run's id (strop runs list)")
        add_target(q, "trainer")
    p.set_defaults(func=_cmd_runs)


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else "-"


def _cmd_runs(a) -> int:
    from strop.client.trainer import TrainerClient

    with TrainerClient(target_of(a, DEFAULT_TRAINER)) as tc:
        if a.runs_cmd == "list":
            for r in tc.list_training_runs(a.session):
                print(
                    f"{r.run_id}\t{r.tenant or '-'}\t{r.session_id}\trank={r.lora.rank}\tsteps={r.step}"
                    f"\tpending={r.pending_futures}\t{_when(r.last_activity_at)}\t{r.name}"
                )
        elif a.runs_cmd == "show":
            print_json(tc.get_training_run(a.run_id))
        else:
            print_json(tc.delete_training_run(a.run_id))
    return 0
