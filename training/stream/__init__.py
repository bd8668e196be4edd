"""--stream: corpora of shards read, tokenized and packed on the fly, resumed exactly at any world size (issue 60, in progress)."""
