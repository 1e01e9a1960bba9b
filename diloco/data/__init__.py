"""Data worker side: raw chunks -> tokens -> packed, checksummed shards."""
