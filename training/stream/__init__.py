"""--stream: corpora of shards larger than a node, read, tokenized and packed on the fly."""
