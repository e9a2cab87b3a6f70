"""The JSON log format: one parseable object per line, with the ids of the job or export a record concerns."""

from __future__ import annotations

import io
import json
import logging
import threading

from strop.common import logs


def _capture() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("strop.test.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def test_each_record_is_one_json_line_with_the_ids_it_concerns():
    logger, out = _capture()

    def job_thread():  # as a trainer job's thread: bound once, every line carries the id
        logs.bind(job_id="job-1")
        logger.info("step %d: loss %.2f\nnext line", 3, 1.5)

    t = threading.Thread(target=job_thread)
    t.start()
    t.join()
    logger.warning("no ids here: ünïcode")
    logger.info("given explicitly", extra={"export_id": "exp-9"})
    token = logs.bind(session_id="sess-2")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    finally:
        logs.unbind(token)
    logger.info("unbound again")

    lines = out.getvalue().splitlines()
    assert len(lines) == 5, "a message with a newline is still one line"
    recs = [json.loads(line) for line in lines]
    assert [r["message"] for r in recs] == [
        "step 3: loss 1.50\nnext line",
        "no ids here: ünïcode",
        "given explicitly",
        "failed",
        "unbound again",
    ]
    assert [r["level"] for r in recs] == ["INFO", "WARNING", "INFO", "ERROR", "INFO"]
    assert {r["logger"] for r in recs} == {"strop.test.json"}
    assert recs[0]["job_id"] == "job-1" and "job_id" not in recs[1], "a thread's binding stays in its thread"
    assert recs[2]["export_id"] == "exp-9"
    assert recs[3]["session_id"] == "sess-2" and "ValueError: boom" in recs[3]["exc"]
    assert "session_id" not in recs[4]
    assert all(r["ts"].endswith("+00:00") and "T" in r["ts"] for r in recs)


def test_the_services_take_the_log_format_flag():
    from strop.common.server_cli import metrics_address, service_parser

    p = service_parser("x", "x", name="trainer", port=1)
    a = p.parse_args(["--log-format", "json", "--metrics-port", "9090", "--address", "0.0.0.0:50051"])
    assert (a.log_format, metrics_address(a)) == ("json", "0.0.0.0:9090")
    a = p.parse_args([])
    assert (a.log_format, a.metrics_port, metrics_address(a), a.database_url) == ("text", 0, None, "")
