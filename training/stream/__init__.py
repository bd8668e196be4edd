"""--stream: a corpus of shards read, tokenized and packed as the run goes, resumed exactly at any world size."""
