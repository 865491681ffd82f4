"""The errors are values: equal to their pickled and deep-copied selves, and told apart by their fields."""

import copy
import pickle

import pytest

from lightning_ckguard.errors import (
    CheckpointRestoreError,
    CheckpointWriteError,
    NonFiniteGradientError,
    Spike,
    StateCheckError,
)


def _rejection(**overrides):
    fields = dict(ranks=[1, 0], first_step=3, last_step=5, num_steps=2, global_step=6, parameters=["layer.weight"],
                  skipped_steps=1, pending_rejection=False)
    return NonFiniteGradientError(**{**fields, **overrides})


def _spike(step: int) -> Spike:
    return Spike(measure="loss", first_step=step, last_step=step, value=10.0 * step, baseline=1.0, ratio=10.0 * step,
                 deviations=50.0)


def _state_check_failure(**overrides):
    fields = dict(ranks=[1], global_step=4, cause="NotImplementedError: Cannot copy out of meta tensor; no data!")
    return StateCheckError(**{**fields, **overrides})


def _write_failure(**overrides):
    fields = dict(ranks=[1], filepath="/ckpts/epoch=0.ckpt", cause="OSError: No space left on device")
    return CheckpointWriteError(**{**fields, **overrides})


def _restore_failure(**overrides):
    fields = dict(ranks=[0, 1], filepath="/ckpts/last.ckpt", cause="RuntimeError: Error(s) in loading state_dict")
    return CheckpointRestoreError(**{**fields, **overrides})


ERRORS = [
    pytest.param(_rejection, id="NonFiniteGradientError"),
    pytest.param(lambda: _rejection(unnamed_ranks=4000), id="NonFiniteGradientError-past-16-ranks"),
    pytest.param(_write_failure, id="CheckpointWriteError"),
    pytest.param(lambda: _write_failure(removal=True), id="CheckpointWriteError-removal"),
    pytest.param(lambda: _write_failure(cause=None), id="CheckpointWriteError-no-cause"),
    pytest.param(_restore_failure, id="CheckpointRestoreError"),
    pytest.param(lambda: _restore_failure(cause=None), id="CheckpointRestoreError-no-cause"),
    pytest.param(lambda: _restore_failure(world_size=4), id="CheckpointRestoreError-world-size"),
    pytest.param(_state_check_failure, id="StateCheckError"),
]


@pytest.mark.parametrize("make", ERRORS)
@pytest.mark.parametrize("duplicate", [lambda e: pickle.loads(pickle.dumps(e)), copy.deepcopy, copy.copy],
                         ids=["pickle", "deepcopy", "copy"])
def test_a_copy_equals_the_original(make, duplicate):
    error = make()
    twin = duplicate(error)
    assert twin is not error
    assert twin == error and hash(twin) == hash(error)
    assert str(twin) == str(error)  # the message is rebuilt from the same fields


@pytest.mark.parametrize(("make", "changes"), [
    (_rejection, dict(ranks=[1])),
    (_rejection, dict(first_step=4)),
    (_rejection, dict(last_step=4)),
    (_rejection, dict(num_steps=1)),
    (_rejection, dict(global_step=8)),
    (_rejection, dict(parameters=[])),
    (_rejection, dict(skipped_steps=0)),
    (_rejection, dict(pending_rejection=True)),
    (_rejection, dict(unnamed_ranks=3)),
    (_rejection, dict(spikes=[_spike(4)])),
    (_write_failure, dict(ranks=[0, 1])),
    (_write_failure, dict(filepath="/ckpts/other.ckpt")),
    (_write_failure, dict(cause=None)),
    (_write_failure, dict(removal=True)),
    (_restore_failure, dict(ranks=[1])),
    (_restore_failure, dict(filepath="/ckpts/other.ckpt")),
    (_restore_failure, dict(cause=None)),
    (_restore_failure, dict(world_size=2)),
    (_state_check_failure, dict(ranks=[0, 1])),
    (_state_check_failure, dict(global_step=6)),
    (_state_check_failure, dict(cause=None)),
])
def test_errors_with_different_fields_differ(make, changes):
    assert make(**changes) != make()


def test_errors_of_different_types_differ():
    class Subclass(CheckpointWriteError):
        pass

    error = _write_failure()
    twin = Subclass(ranks=error.ranks, filepath=error.filepath, cause=error.cause)
    assert twin != error and error != twin
    assert _rejection() != RuntimeError(str(_rejection()))


def test_equal_errors_are_interchangeable_as_keys():
    assert len({_rejection(), _rejection(ranks=[0, 1]), copy.deepcopy(_rejection())}) == 1


def test_a_copy_keeps_every_field():
    """Rebuilt from its fields: each one comes back, not only an equal key."""
    for error in (_write_failure(removal=True), _restore_failure(), _restore_failure(world_size=1),
                  _state_check_failure()):
        twin = pickle.loads(pickle.dumps(error))
        assert type(twin) is type(error) and vars(twin) == vars(error) and twin.args == error.args


def test_write_and_restore_failures_of_the_same_fields_differ():
    write = _write_failure()
    assert write != _restore_failure(ranks=write.ranks, filepath=write.filepath, cause=write.cause)


@pytest.mark.parametrize(("ranks", "world_size", "says", "never"), [
    pytest.param([0], 1, "This process may hold part of the checkpoint's state", "other ranks", id="one-process"),
    pytest.param([0, 1], 2, "It failed on every rank, and each may hold part", "other ranks", id="every-rank"),
    pytest.param([1], 2, "The other ranks may have restored it, so the ranks may no longer hold the same state",
                 "every rank, and", id="some-ranks"),
    pytest.param([0], None, "A rank where it failed may hold part of the checkpoint's state, and a rank where it did "
                 "not may hold all of it", "other ranks", id="world-size-unknown"),
])
def test_a_restore_failure_says_what_the_ranks_hold_as_far_as_it_knows(ranks, world_size, says, never):
    """One process has no other ranks, and when every rank failed none restored it: the message says so, and without
    the world size (a caller of an earlier release) it claims neither."""
    fields = {} if world_size is None else {"world_size": world_size}
    message = str(_restore_failure(ranks=ranks, **fields))
    assert says in message and never not in message, message
    rank_words = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    assert message.startswith(f"Restoring the checkpoint /ckpts/last.ckpt failed on {rank_words}: "), message
    assert message.endswith("restore again, or stop." if world_size == 1 else "restore again on every rank, or stop.")


def test_a_rejection_spells_out_three_spikes_and_counts_the_others():
    message = str(_rejection(spikes=[_spike(step) for step in range(1, 6)]))
    assert [f"the loss spiked at step {step} to" in message for step in range(1, 6)] == [True] * 3 + [False] * 2
    assert "; and 2 more spike(s)" in message, message
