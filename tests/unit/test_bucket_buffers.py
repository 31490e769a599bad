"""Bucket buffers reused between publishes (operators/weights/host_buffers.py, packed into by operators/weights/buckets.py): a buffer goes back to
the pool only when nothing made from it is alive, so a version the weight sender still holds is never
overwritten by the next pack, and one it dropped is packed into again without new host memory."""

from __future__ import annotations

import gc

import numpy as np
import torch

from operators.weights.gloo_wire import bucket_bytes
from operators.weights.host_buffers import BucketBuffers
from operators.weights.buckets import pack_buckets


def _weights(value: float, dtype=torch.float32):
    return [(f"layer{i}.weight", torch.full((64, 32), value + i, dtype=dtype)) for i in range(6)]


def _pointers(buckets) -> set[int]:
    return {bucket.data.__array_interface__["data"][0] for bucket in buckets}


def _values(buckets) -> list[float]:
    return [float(array.reshape(-1)[0]) for bucket in buckets for _, array in bucket.arrays()]


def test_a_held_version_is_not_packed_over_and_a_dropped_one_is_reused():
    pool = BucketBuffers()
    bucket_mb = 3 * 64 * 32 * 4 / 2**20  # three tensors a bucket: two buckets a version
    first = list(pack_buckets(_weights(1.0), bucket_mb, buffers=pool))
    assert len(first) == 2 and _values(first) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    second = list(pack_buckets(_weights(10.0), bucket_mb, buffers=pool))  # `first` is still held
    assert not _pointers(first) & _pointers(second)
    assert _values(first) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # untouched by the second pack
    held = pool.nbytes
    first_pointers = _pointers(first)
    del first
    gc.collect()
    third = list(pack_buckets(_weights(100.0), bucket_mb, buffers=pool))
    assert _pointers(third) == first_pointers  # the dropped version's buffers, packed again
    assert pool.nbytes == held  # no new host memory
    assert _values(third) == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    assert _values(second) == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]


def test_anything_made_from_a_bucket_keeps_its_buffer_in_use():
    pool = BucketBuffers()
    bucket_mb = 6 * 64 * 32 * 2 / 2**20  # one bf16 bucket a version
    (bucket,) = pack_buckets(_weights(1.0, torch.bfloat16), bucket_mb, buffers=pool)
    payload = bucket_bytes(bucket)  # what the sender broadcasts: a torch tensor over the bucket's bytes
    view = next(bucket.tensors())[1]  # a torch view of one tensor, as an engine loads it
    pointer = bucket.data.__array_interface__["data"][0]
    del bucket
    gc.collect()
    (other,) = pack_buckets(_weights(7.0, torch.bfloat16), bucket_mb, buffers=pool)
    assert other.data.__array_interface__["data"][0] != pointer  # the payload still reads the old one
    assert float(view[0, 0]) == 1.0 and payload.numel() == 6 * 64 * 32 * 2
    del payload, view, other
    gc.collect()
    (again,) = pack_buckets(_weights(3.0, torch.bfloat16), bucket_mb, buffers=pool)
    assert again.data.__array_interface__["data"][0] == pointer  # both are free again: the first one is taken
    assert pool.nbytes == 2 * 6 * 64 * 32 * 2  # two buffers in all, none added
    assert np.array_equal(next(again.tensors())[1].float().numpy(), np.full((64, 32), 3.0, dtype=np.float32))


def test_an_engine_receives_into_reused_buffers_and_never_over_a_version_it_holds():
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from operators.weights.gloo_wire import encode_layout, layout_of, open_group, post_version, receive_version

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    versions = {v: list(pack_buckets(_weights(float(10 * v)), 3 * 64 * 32 * 4 / 2**20)) for v in (1, 2, 3)}
    got, ready, go_on = {}, threading.Event(), threading.Event()
    pool = BucketBuffers()

    def engine():
        group = open_group("127.0.0.1", server.port, 1, 2, 60)
        got[1] = receive_version(group, 60, buffers=pool)[2]
        got[2] = receive_version(group, 60, buffers=pool)[2]  # version 1 is still held
        ready.set()
        go_on.wait(60)
        got[3] = receive_version(group, 60, buffers=pool)[2]  # version 1 was dropped meanwhile

    thread = threading.Thread(target=engine)
    thread.start()
    trainer = open_group("127.0.0.1", server.port, 0, 2, 60)
    for version in (1, 2):
        header, layout = encode_layout(layout_of(version, versions[version], None))
        for work in post_version(trainer, header, layout, [bucket_bytes(b) for b in versions[version]], 60):
            work.wait()
    assert ready.wait(60)
    assert not _pointers(got[1]) & _pointers(got[2])
    assert _values(got[1]) == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]  # not received over
    first = _pointers(got.pop(1))
    gc.collect()
    go_on.set()
    header, layout = encode_layout(layout_of(3, versions[3], None))
    for work in post_version(trainer, header, layout, [bucket_bytes(b) for b in versions[3]], 60):
        work.wait()
    thread.join(60)
    assert _pointers(got[3]) == first  # received into version 1's buffers
    assert _values(got[3]) == [30.0, 31.0, 32.0, 33.0, 34.0, 35.0]
    assert _values(got[2]) == [20.0, 21.0, 22.0, 23.0, 24.0, 25.0]


def _in_use(pool: BucketBuffers) -> int:
    return sum(not slot.free() for slot in pool._slots)


def test_a_pack_that_fails_or_is_stopped_midway_gives_its_buffers_back():
    pool = BucketBuffers()
    bucket_mb = 3 * 64 * 32 * 4 / 2**20  # two buckets a version

    def failing():  # a ZeRO-3 gather that raises on the fifth tensor, inside the second bucket
        for i, pair in enumerate(_weights(1.0)):
            if i == 4:
                raise RuntimeError("gather failed")
            yield pair

    done = []
    try:
        for bucket in pack_buckets(failing(), bucket_mb, buffers=pool):
            done.append(bucket)
    except RuntimeError:
        pass
    assert len(done) == 1 and len(pool._slots) == 2
    assert _in_use(pool) == 1  # the finished bucket is held; the unfinished one's buffer is free
    stopped = pack_buckets(_weights(2.0), bucket_mb, buffers=pool)
    first = next(stopped)  # packed into the failed pack's free buffer; the second bucket takes a third
    assert len(pool._slots) == 3 and _in_use(pool) == 3
    stopped.close()  # the caller gives up midway (its own failure)
    assert _in_use(pool) == 2  # `done` and `first`: the unfinished bucket's buffer is free
    held = pool.nbytes
    del done, first, bucket  # the loop variable holds the first too
    gc.collect()
    assert _in_use(pool) == 0
    again = list(pack_buckets(_weights(3.0), bucket_mb, buffers=pool))
    assert pool.nbytes == held  # no new host memory: the failures gave their buffers back
    assert _values(again) == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def test_a_receive_that_times_out_midway_gives_its_buffer_back():
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from operators.weights.gloo_wire import encode_layout, layout_of, open_group, post_broadcast, receive_version

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    buckets = list(pack_buckets(_weights(1.0), 3 * 64 * 32 * 4 / 2**20))
    pool, failure = BucketBuffers(), []

    def engine():
        group = open_group("127.0.0.1", server.port, 1, 2, 60)
        try:
            receive_version(group, 2, buffers=pool)
        except Exception as err:
            failure.append(err)

    thread = threading.Thread(target=engine)
    thread.start()
    trainer = open_group("127.0.0.1", server.port, 0, 2, 60)
    header, layout = encode_layout(layout_of(1, buckets, None))
    for tensor in (header, layout):  # the trainer dies after the layout: no bucket ever comes
        post_broadcast(trainer, tensor, 60).wait()
    thread.join(60)
    assert not thread.is_alive() and len(failure) == 1
    assert len(pool._slots) == 1 and _in_use(pool) == 0
