"""Record: which gradients each rank applies and whether they are finite, on the device, with no host read and no
collective per step; and the local state a checkpoint is about to hold."""
