"""Publish: the ledger as a value, one boundary as a transaction, and one writer per fit (staged, background, or
direct) that writes, links and evicts; where the checkpoints live (local disk or object storage); the seal on every
write of a Trainer."""
