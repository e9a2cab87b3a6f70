"""The OpenAI gateway's state on both state backends (SQLite and PostgreSQL): documents, numbered records paged
newest first on their ids, a trainer event's records stored once, and everything there again after a reopen."""

from __future__ import annotations

from strop.gateways.openai.store import GatewayStore


def test_the_gateway_store_pages_dedupes_and_persists(database_url, tmp_path):
    store = GatewayStore(database_url, tmp_path)
    store.put("oai_jobs", {"id": "ftjob-a", "owner": "o1", "created_at": 10, "t": 10.5, "status": "queued"})
    store.put("oai_jobs", {"id": "ftjob-b", "owner": "o1", "created_at": 10, "t": 10.7, "status": "queued"})
    store.put("oai_jobs", {"id": "ftjob-c", "owner": "o2", "created_at": 11, "t": 11.0, "status": "queued"})
    assert [d["id"] for d in store.list("oai_jobs", "o1")] == ["ftjob-b", "ftjob-a"]  # newest first, by t
    assert (
        store.update_if("oai_jobs", "ftjob-a", "status", "running", status="x") is None
    )  # not running: unchanged
    assert store.update_if("oai_jobs", "ftjob-a", "status", "queued", status="running")["status"] == "running"
    ids = [
        store.append("oai_events", "ftjob-a", "ftevent", {"i": i}, src=f"job-1:{i}")["id"] for i in range(5)
    ]
    assert ids == [f"ftevent-a-{n}" for n in range(1, 6)]
    assert (
        store.append("oai_events", "ftjob-a", "ftevent", {"i": 2}, src="job-1:2") is None
    )  # read again: stored once
    store.close()

    store = GatewayStore(database_url, tmp_path)  # a restarted gateway
    assert store.get("oai_jobs", "ftjob-a")["status"] == "running"
    page, more = store.page("oai_events", "ftjob-a", None, 2)
    assert [d["i"] for d in page] == [4, 3] and more
    page, more = store.page(
        "oai_events", "ftjob-a", page[-1]["id"], 2
    )  # OpenAI's after= the last id of a page
    assert [d["i"] for d in page] == [2, 1] and more
    page, more = store.page("oai_events", "ftjob-a", page[-1]["id"], 2)
    assert [d["i"] for d in page] == [0] and not more
    assert store.page("oai_events", "ftjob-a", "ftevent-nope", 2) == ([], False)
    store.close()
