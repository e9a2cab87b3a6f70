"""Load benchmark of the trainer service: unary and health latency while hundreds of event streams are open.

Starts the trainer service as its own process (``python -m strop.trainer_svc``) on 127.0.0.1 over a generated
tiny 4-bit Llama, starts
``--jobs`` training jobs (one running on the device, the rest QUEUED behind it), opens ``--streams``
WatchJob streams on them (a share of them never read: clients that stop reading), and then measures, from
a separate asyncio channel, ``--samples`` calls each of ``grpc.health.v1.Health/Check``, ``GetJob`` and
``ListJobs``: p50, p99 and max latency, and how many missed a 5 s deadline. Not a test: the numbers depend
on the machine; they are recorded in bench/RESULTS.md with the command.

``--replay N`` measures a replay storm instead: once the running job has N events, every one of ``--streams``
streams asks for them all (``WatchJob(after_seq=0)``, read as raw bytes so the client's decoding costs nothing)
while the probes run; it also reports each stream's time to its first event and how many got none within 5 s.

Usage::

    TRITON_INTERPRET=1 python bench/load_bench.py --streams 500 --jobs 4 --samples 200 --json bench/out/load.json
    TRITON_INTERPRET=1 python bench/load_bench.py --streams 500 --jobs 1 --replay 900 --samples 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def measure(
    target: str, job_ids: list[str], streams: int, unread_share: float, samples: int, replay: int = 0
) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from strop.v1 import trainer_pb2, trainer_pb2_grpc

    async with grpc.aio.insecure_channel(target) as streams_ch, grpc.aio.insecure_channel(target) as probe_ch:
        stub = trainer_pb2_grpc.TrainerServiceStub(streams_ch)
        raw_watch = streams_ch.unary_stream(
            "/strop.v1.TrainerService/WatchJob",
            request_serializer=trainer_pb2.WatchJobRequest.SerializeToString,
        )
        received, first, complete = [0], [], []
        opened = time.perf_counter()

        async def reader(job_id: str) -> None:
            n = 0
            async for _ in raw_watch(trainer_pb2.WatchJobRequest(job_id=job_id, after_seq=0)):
                received[0] += 1
                n += 1
                if n == 1:
                    first.append(time.perf_counter() - opened)
                if n == replay:
                    complete.append(time.perf_counter() - opened)

        unread = 0 if replay else int(streams * unread_share)
        calls = [
            stub.WatchJob(trainer_pb2.WatchJobRequest(job_id=job_ids[i % len(job_ids)]))
            for i in range(unread)
        ]
        readers = [asyncio.create_task(reader(job_ids[i % len(job_ids)])) for i in range(streams - unread)]
        # a replay storm is measured while it runs; otherwise once every stream is open and its handler waiting
        await asyncio.sleep(0.2 if replay else 3.0)
        probe = trainer_pb2_grpc.TrainerServiceStub(probe_ch)
        health = health_pb2_grpc.HealthStub(probe_ch)
        rpcs = {
            "Health/Check": lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5),
            "GetJob": lambda: probe.GetJob(trainer_pb2.GetJobRequest(job_id=job_ids[-1]), timeout=5),
            "ListJobs": lambda: probe.ListJobs(trainer_pb2.ListJobsRequest(), timeout=5),
        }
        out = {}
        for name, call in rpcs.items():
            lat, missed = [], 0
            for _ in range(samples):
                t0 = time.perf_counter()
                try:
                    await call()
                except grpc.aio.AioRpcError as err:
                    if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                        missed += 1
                    else:
                        raise
                lat.append(time.perf_counter() - t0)
            out[name] = {
                "p50_ms": 1e3 * statistics.median(lat),
                "p99_ms": 1e3 * percentile(lat, 0.99),
                "max_ms": 1e3 * max(lat),
                "missed_deadline": missed,
            }
        out["events_received_by_readers"] = received[0]
        if replay:
            await asyncio.sleep(max(0.0, 5.0 - (time.perf_counter() - opened)))
            while len(complete) < streams and time.perf_counter() - opened < 300:
                await asyncio.sleep(0.2)
            out["replay_complete_s"] = {
                "streams_complete": len(complete),
                "p50": statistics.median(complete) if complete else None,
                "max": max(complete) if complete else None,
            }
            out["first_event_s"] = {
                "streams": streams,
                "with_an_event": len(first),
                "within_5s": sum(t <= 5.0 for t in first),
                "p50": statistics.median(first) if first else None,
                "max": max(first) if first else None,
            }
        for c in calls:
            c.cancel()
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--unread-share", type=float, default=0.8, help="share of streams that never read")
    p.add_argument("--jobs", type=int, default=4, help="one runs, the rest wait QUEUED")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument(
        "--replay", type=int, default=0, help="a replay storm once the running job has this many events"
    )
    p.add_argument("--json")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from strop.client import LoraConfig, TrainConfig, TrainerClient, TrainMethod
    from strop.demo.data import sft_rows
    from strop.demo.services import start_service
    from strop.fixtures import make_tiny_model, quantize_4bit

    work = Path(tempfile.mkdtemp(prefix="strop-load-"))
    make_tiny_model(work / "models" / "tiny-llama", arch="llama", tokenizer="bpe", seed=0)
    quantize_4bit(work / "models" / "tiny-llama", work / "models" / "tiny-llama-4bit")
    args = [
        "--model-root",
        str(work / "models"),
        "--artifact-root",
        str(work / "a"),
        "--state-dir",
        str(work / "s"),
    ]
    service = start_service("trainer", args, work)
    target = service.target
    try:
        with TrainerClient(target) as tc:
            ds = tc.upload_dataset(sft_rows())
            long = TrainConfig(method=TrainMethod.SFT, max_steps=100_000, batch_size=2, learning_rate=1e-3)
            jobs, sessions = [], []
            for _ in range(a.jobs):
                s = tc.load_model("tiny-llama-4bit")
                tc.attach_lora(s.session_id, LoraConfig(r=4, alpha=8))
                sessions.append(s.session_id)
                jobs.append(next(iter(tc.train(s.session_id, ds.dataset_id, long))).job_id)
            while a.replay and tc.get_job(jobs[0]).last_seq < a.replay:
                time.sleep(0.5)
            states = [tc.get_job(j).state.value for j in jobs]
            replayed = tc.get_job(jobs[0]).last_seq
            result = asyncio.run(measure(target, jobs, a.streams, a.unread_share, a.samples, replay=a.replay))
            result["replayed_events"] = replayed if a.replay else 0
            for j in jobs:
                tc.cancel_job(j)
            for j in jobs:
                tc.wait_job(j)
        result.update(streams=a.streams, unread_share=a.unread_share, jobs=a.jobs, job_states=states)
    finally:
        service.stop()
    print("| RPC | p50 ms | p99 ms | max ms | missed 5 s deadline |\n|---|---:|---:|---:|---:|")
    for name in ("Health/Check", "GetJob", "ListJobs"):
        r = result[name]
        print(
            f"| {name} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['missed_deadline']} |"
        )
    print(
        f"jobs {result['job_states']}; events received by the readers: {result['events_received_by_readers']}"
    )
    if a.replay:
        print(
            f"replay of the first {a.replay} of {result['replayed_events']} events to {a.streams} streams: "
            f"first event {result['first_event_s']}; all {a.replay} received {result['replay_complete_s']}"
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
