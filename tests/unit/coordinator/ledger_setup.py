"""What the ledger's tests build on: chunk specs, a chunk made into a shard, a push of rows."""

from diloco.coordinator.ledger import ChunkLease
from diloco.data.chunks import ChunkSpec, Segment

TTL = 10.0
ROWS = 10
TOKENS_PER_ROW = 8


def spec(index, split="train"):
    return ChunkSpec(
        index=index, segments=(Segment(f"file:///data/f{index}.txt", 0, 100 + index, True),), split=split
    )


def make(ledger, splits):
    ledger.initialize([spec(i, s) for i, s in enumerate(splits)], dataset="test")


def complete(ledger, worker, chunk_id, completion_id=None, rows=ROWS):
    return ledger.complete_chunk(
        worker,
        chunk_id,
        completion_id or f"c{chunk_id}",
        f"file:///shards/{chunk_id}.zst",
        rows,
        rows * TOKENS_PER_ROW,
        "sum",
        1234,
        {},
    )


def with_train_shard(ledger, splits=("train",)):
    """Chunks processed into shards; returns the shard ids in chunk order."""
    make(ledger, splits)
    ids = []
    for _ in splits:
        lease = ledger.lease_chunk("d1", TTL)
        assert isinstance(lease, ChunkLease)
        result = complete(ledger, "d1", lease.chunk_id)
        assert result.accepted
        ids.append(result.shard_id)
    return ids


def push(ledger, push_id, spans, worker="L1", released=()):
    return ledger.record_push(
        push_id, worker, 0, 0, 5, sum(b - a for _, a, b in spans) * TOKENS_PER_ROW, spans, list(released)
    )
