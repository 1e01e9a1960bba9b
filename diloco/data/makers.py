"""What a data worker makes of a chunk: packed token rows (the default), or the columns of the
user's preprocess (data.preprocess). Either way one checksummed shard, written atomically."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from diloco.config import RunConfig
from diloco.corpus import file_kind, resolve_dataset
from diloco.data.preprocess import process_samples
from diloco.data.process import process_chunk
from diloco.data.samples import image_classes
from diloco.data.shard import ShardInfo, column_schema, write_columns, write_shard
from diloco.data.types import ChunkSpec, RecordStats
from diloco.plugins import resolve
from diloco.tokenizer import Tokenizer


@dataclass
class Made:
    info: ShardInfo
    bytes_in: int
    dropped_tokens: int
    stats: RecordStats
    schema: str  # the columns as JSON ("" for packed token rows)


class ShardMaker(Protocol):
    def make(self, chunk: ChunkSpec, uri: str) -> Made: ...


class TokenShards:
    """Tokenize and pack: rows of seq_len + 1 token ids (format 2)."""

    def __init__(self, tokenizer: Tokenizer, config: RunConfig) -> None:
        self.tokenizer, self.config = tokenizer, config

    def make(self, chunk: ChunkSpec, uri: str) -> Made:
        d = self.config.data
        processed = process_chunk(
            chunk, self.tokenizer, self.config.model.seq_len, d.text_field, d.max_record_bytes
        )
        info = write_shard(
            uri, processed.rows, tokenizer_id=self.tokenizer.id, vocab_size=self.tokenizer.vocab_size,
            chunk_index=chunk.index, meta={"split": chunk.split},
        )  # fmt: skip
        return Made(info, processed.bytes_in, processed.dropped_tokens, processed.stats, "")


class SampleShards:
    """The user's preprocess: records to named columns (format 3), one sample a row."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.spec = config.data.preprocess
        self.fn = resolve(self.spec, "data.preprocess")  # a DilocoError names what is missing
        self._classes: list[str] | None = None

    def classes(self, chunk: ChunkSpec) -> list[str]:
        """An image dataset's class names, listed once (only when a chunk holds images)."""
        if self._classes is None:
            if not any(file_kind(s.uri) == "image" for s in chunk.segments):
                return []
            recorded = self.config.data.classes  # the run's, filled in at its first start
            self._classes = recorded or image_classes(resolve_dataset(self.config.data.dataset, samples=True))
        return self._classes

    def make(self, chunk: ChunkSpec, uri: str) -> Made:
        done = process_samples(
            chunk,
            self.fn,
            self.spec,
            classes=self.classes(chunk),
            max_record_bytes=self.config.data.max_record_bytes,
        )
        info = write_columns(uri, done.columns, chunk_index=chunk.index, meta={"split": chunk.split})
        return Made(
            info, done.bytes_in, 0, done.stats, json.dumps(column_schema(done.columns), sort_keys=True)
        )


def shard_maker(config: RunConfig, tokenizer: Tokenizer) -> ShardMaker:
    return SampleShards(config) if config.data.preprocess else TokenShards(tokenizer, config)
