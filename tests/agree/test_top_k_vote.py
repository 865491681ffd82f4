"""The top-K vote's pure parts: each rank's local decision, and the vote without peers (no Trainer, no collective)."""

from types import SimpleNamespace

import pytest
import torch

from helpers import reducing_with_peers
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


def test_without_peers_the_vote_is_the_local_decision_and_runs_no_collective(monkeypatch):
    ops = reducing_with_peers(monkeypatch)  # any collective would fail: nothing is queued
    strategy = SimpleNamespace(world_size=1, global_rank=0)
    assert agree_on_top_k(strategy, present=True, improves=True) == TopKVote(improves=True)
    assert agree_on_top_k(strategy, present=True, improves=False) == TopKVote(improves=False)
    missing = TopKVote(improves=False, missing_ranks=(0,), missing_everywhere=True)
    assert agree_on_top_k(strategy, present=False, improves=False) == missing
    assert ops == []


def _rank(rank: int, world_size: int = 3) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, global_rank=rank, root_device=torch.device("cpu"))


def test_with_peers_one_all_reduce_decides_for_every_rank(monkeypatch):
    # rank 1 votes no; rank 2 lacks the key
    ops = reducing_with_peers(monkeypatch, [local_vote(_rank(1), True, False), local_vote(_rank(2), False, False)])
    assert agree_on_top_k(_rank(0), present=True, improves=True) == TopKVote(improves=False, missing_ranks=(2,))
    assert ops == ["max"]


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([(True, True), (True, True)], TopKVote(improves=True)),
        ([(True, True), (True, False)], TopKVote(improves=False)),  # unanimous, as ModelCheckpoint's reduction
        ([(True, True), (False, False)], TopKVote(improves=False, missing_ranks=(1,))),
        ([(False, False), (False, False)], TopKVote(improves=False, missing_ranks=(0, 1), missing_everywhere=True)),
    ],
)
def test_the_vote_of_every_ranks_integers_is_the_same_wherever_they_were_reduced(votes, expected):
    words = torch.tensor([local_vote(_rank(rank, 2), *vote) for rank, vote in enumerate(votes)])
    assert vote_of(words.amax(0).tolist(), 2) == expected


def test_the_ranks_lacking_the_key_are_named_in_words_that_do_not_grow_with_the_world(monkeypatch):
    world = 16_384
    votes = [local_vote(_rank(rank, world), present=rank not in (5, 9000), improves=True) for rank in (5, 9000, 3)]
    assert {len(words) for words in votes} == {len(local_vote(_rank(0, 2), True, True))}
    assert vote_of(torch.tensor(votes).amax(0).tolist(), world).missing_ranks == (5, 9000)


def test_the_vote_rides_in_the_agreement_and_leaves_the_verdict_as_it_was():
    from lightning_ckguard import GradientGuard

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    guard = GradientGuard(model)
    guard.record()
    alone = guard.agree(None, global_step=1)
    vote = local_vote(None, True, False)
    verdict, carried = guard.agree_carrying(None, vote, global_step=1)
    assert carried == tuple(vote)
    assert verdict == alone
