"""The Trainer-free core: ``CheckpointPublisher``, agreement and publication for a Fabric or ``torch.distributed``
loop, through the same writer as the callback."""
