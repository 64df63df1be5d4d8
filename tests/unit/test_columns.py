"""Columns (api_schemas/jobs.py): a batch's per-datum arrays stored end to end, and their Tinker encoding."""

from __future__ import annotations

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.arrays import Column
from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, JobResult
from api_schemas.tinker.proto import encode_forward_backward_result


def test_a_column_gives_back_each_datums_array() -> None:
    arrays = [np.arange(6).reshape(3, 2), None, np.arange(4).reshape(2, 2) + 10]
    col = Column.of(arrays)
    assert col.dtype == "int64" and col.shapes == ((3, 2), None, (2, 2))
    got = col.arrays()
    assert got[1] is None
    for want, have in zip((arrays[0], arrays[2]), (got[0], got[2])):
        assert have is not None and have.dtype == np.int64 and np.array_equal(have, want)
    floats = Column.of([np.array([1.5, 2.5], dtype=np.float64), np.array([3], dtype=np.int64)])
    assert floats.dtype == "float32" and [a.tolist() for a in floats.arrays() if a is not None] == [[1.5, 2.5], [3.0]]


def test_a_batch_keeps_datums_and_names_that_only_some_datums_have() -> None:
    fb = ForwardBackward.build([(np.arange(3), {"target_tokens": np.arange(1, 4), "weights": np.ones(3)}),
                                (np.arange(5), {"target_tokens": np.arange(1, 6)})],
                               forward_only=False, loss_fn="cross_entropy")
    assert (fb.rows, fb.max_len, fb.tokens) == (2, 5, 8)
    (t0, x0), (t1, x1) = fb.datums()
    assert t0.tolist() == [0, 1, 2] and t1.tolist() == [0, 1, 2, 3, 4]
    assert set(x0) == {"target_tokens", "weights"} and set(x1) == {"target_tokens"}
    assert x1["target_tokens"].tolist() == [1, 2, 3, 4, 5] and x0["weights"].dtype == np.float32


def test_results_travel_as_json_and_encode_as_the_sdks_array_record() -> None:
    outs = [{"logprobs": np.array([-1.0, -2.0], dtype=np.float32), "ids": np.array([[1, 2], [3, 4]])},
            {"logprobs": np.array([-3.0], dtype=np.float32), "ids": np.array([[5, 6]])}]
    result = ForwardBackwardResult.of(outs, {"loss:sum": 6.0})
    again = JobResult.from_body("j", JobResult(job_id="j", output=result).body).output
    assert again == result
    assert [{k: v.tolist() for k, v in o.items()} for o in result.datum_outputs()] == \
        [{k: v.tolist() for k, v in o.items()} for o in outs]
    msg = pb.ForwardBackwardOutput.FromString(encode_forward_backward_result(result))
    record = msg.loss_fn_outputs[0]
    assert msg.metrics["loss:sum"] == 6.0 and record.num_datums == 2
    lp = record.fields["logprobs"]
    assert np.frombuffer(lp.offsets, "<i8").tolist() == [0, 8, 12] and lp.dtype == pb.DTYPE_FLOAT32
    assert np.frombuffer(lp.data, "<f4").tolist() == [-1.0, -2.0, -3.0]
    ids = record.fields["ids"]
    assert list(ids.trailing_shape) == [2] and ids.dtype == pb.DTYPE_INT64
    assert np.frombuffer(ids.offsets, "<i8").tolist() == [0, 32, 48]


def test_the_written_array_record_reads_back_for_any_shape_and_size() -> None:
    big = np.arange(70_000, dtype=np.float32)  # lengths of three varint bytes
    outs = [{"logprobs": big, "cube": np.ones((2, 3, 4), dtype=np.float32), "scalar": np.float32(1.5).reshape(())},
            {"logprobs": big[:5], "cube": np.zeros((0, 3, 4), dtype=np.float32), "scalar": np.float32(2.5).reshape(())}]
    msg = pb.ForwardBackwardOutput.FromString(
        encode_forward_backward_result(ForwardBackwardResult.of(outs, {"loss:sum": -0.25, "ünï:mean": 3.0})))
    assert msg.loss_fn_output_type == "ArrayRecord" and dict(msg.metrics) == {"loss:sum": -0.25, "ünï:mean": 3.0}
    record = msg.loss_fn_outputs[0]
    assert record.type_tag == "ArrayRecord" and record.num_datums == 2
    for name in ("logprobs", "cube", "scalar"):
        tensor = record.fields[name]
        ends = np.frombuffer(tensor.offsets, "<i8").tolist()
        assert ends == [0, outs[0][name].nbytes, outs[0][name].nbytes + outs[1][name].nbytes], name
        assert tensor.data == outs[0][name].tobytes() + outs[1][name].tobytes() and tensor.dtype == pb.DTYPE_FLOAT32
        assert list(tensor.trailing_shape) == list(outs[0][name].shape[1:]), name
    empty = pb.ForwardBackwardOutput.FromString(encode_forward_backward_result(ForwardBackwardResult.of([], {})))
    assert empty.loss_fn_outputs[0].num_datums == 0 and not empty.loss_fn_outputs[0].fields
