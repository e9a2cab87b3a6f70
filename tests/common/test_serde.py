"""Dataclasses to protobuf and JSON and back, by field name (``common.serde``)."""

from __future__ import annotations

from strop.common.serde import from_dict, from_proto, to_dict, to_proto
from strop.common.trainer_types import (
    Artifact,
    ArtifactFile,
    Checkpoint,
    DpoMetrics,
    JobEvent,
    JobInfo,
    JobState,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.v1 import trainer_pb2


def test_dataclasses_round_trip_through_protobuf_and_json():
    job = JobInfo(
        job_id="j",
        state=JobState.CANCELLED,
        config=TrainConfig(method=TrainMethod.DPO, dpo_beta=0.2),
        last_checkpoint=Checkpoint(7, Artifact("c", files=[ArtifactFile("f", 1, "ab")], metadata={"k": "v"})),
    )
    msg = to_proto(trainer_pb2.Job, job)
    assert msg.state == trainer_pb2.JOB_STATE_CANCELLED and msg.config.method == trainer_pb2.TRAIN_METHOD_DPO
    assert from_proto(JobInfo, msg) == job
    assert from_dict(JobInfo, to_dict(job)) == job
    ev = JobEvent(job_id="j", seq=4, step=StepMetrics(step=2, loss=1.5, dpo=DpoMetrics(reward_margin=0.3)))
    msg = to_proto(trainer_pb2.JobEvent, ev)
    assert msg.WhichOneof("event") == "step"
    assert from_proto(JobEvent, msg) == ev
