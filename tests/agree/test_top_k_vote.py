"""The top-K vote's pure parts: each rank's local decision, and the vote without peers (no Trainer, no collective)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_ckguard.agree.top_k_vote import TopKVote, agree_on_top_k, local_top_k_decision, local_vote, vote_of


def _values(**values: float) -> dict[str, torch.Tensor]:
    return {path: torch.tensor(value) for path, value in values.items()}


def test_nothing_enters_an_empty_top_k_when_save_top_k_is_zero():
    # used to index best_k_models[""] and raise KeyError
    assert local_top_k_decision(torch.tensor(1.0), {}, "", save_top_k=0, mode="min") is False


def test_a_missing_value_never_enters_the_top_k():
    assert local_top_k_decision(None, {}, "", save_top_k=-1, mode="min") is False


@pytest.mark.parametrize("save_top_k", [-1, 3])
def test_every_value_enters_an_unlimited_or_unfilled_top_k(save_top_k):
    best = _values(a=1.0, b=2.0)
    assert local_top_k_decision(torch.tensor(100.0), best, "b", save_top_k=save_top_k, mode="min") is True


@pytest.mark.parametrize(("mode", "current", "expected"), [("min", 1.5, True), ("min", 2.5, False),
                                                             ("max", 1.5, True), ("max", 0.5, False)])
def test_a_full_top_k_compares_against_its_kth_best(mode, current, expected):
    best = _values(a=1.0, b=2.0)
    kth = "b" if mode == "min" else "a"
    assert local_top_k_decision(torch.tensor(current), best, kth, save_top_k=2, mode=mode) is expected


@pytest.mark.parametrize(("mode", "current", "expected"), [("min", 1.5, True), ("min", 2.5, False),
                                                             ("max", 1.5, True), ("max", 0.5, False)])
def test_a_kth_path_outside_the_top_k_is_found_from_the_values_instead_of_indexed(mode, current, expected):
    best = _values(a=1.0, b=2.0)
    assert local_top_k_decision(torch.tensor(current), best, "gone.ckpt", save_top_k=2, mode=mode) is expected


def test_without_peers_the_vote_is_the_local_decision_and_runs_no_collective():
    def no_collective(_tensor):
        raise AssertionError("a single process must not run a collective")

    strategy = SimpleNamespace(world_size=1, global_rank=0, all_gather=no_collective)
    assert agree_on_top_k(strategy, present=True, improves=True) == TopKVote(improves=True)
    assert agree_on_top_k(strategy, present=True, improves=False) == TopKVote(improves=False)
    assert agree_on_top_k(strategy, present=False, improves=False) == TopKVote(improves=False, missing_ranks=(0,))


def test_with_peers_one_all_gather_decides_for_every_rank():
    calls = []

    def all_gather(tensor):  # rank 1 votes no; rank 2 lacks the key
        calls.append(tensor)
        return torch.stack([tensor, torch.tensor([1, 0]), torch.tensor([0, 0])])

    strategy = SimpleNamespace(world_size=3, global_rank=0, root_device=torch.device("cpu"), all_gather=all_gather)
    assert agree_on_top_k(strategy, present=True, improves=True) == TopKVote(improves=False, missing_ranks=(2,))
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([[1, 1], [1, 1]], TopKVote(improves=True)),
        ([[1, 1], [1, 0]], TopKVote(improves=False)),  # unanimous, as ModelCheckpoint's reduction
        ([[1, 1], [0, 0]], TopKVote(improves=False, missing_ranks=(1,))),
    ],
)
def test_the_vote_of_every_ranks_integers_is_the_same_wherever_they_were_gathered(votes, expected):
    assert vote_of(votes) == expected


def test_the_vote_rides_in_the_agreement_and_leaves_the_verdict_as_it_was():
    from lightning_ckguard import GradientGuard

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    guard = GradientGuard(model)
    guard.record()
    alone = guard.agree(None, global_step=1)
    verdict, carried = guard.agree_carrying(None, local_vote(True, False), global_step=1)
    assert carried == ((1, 0),)
    assert verdict == alone
