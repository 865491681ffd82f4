"""The Lightning adapters: the callback (hooks and ``ModelCheckpoint``'s seams), the runtime of one fit, the two
Lightning packages, argument checks, and the ``ckguard/*`` metrics riding Lightning's flush."""
