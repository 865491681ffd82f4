"""Every public object has a docstring, and the package's help renders (``pydoc``)."""

from __future__ import annotations

import inspect
import pydoc

import pytest

import lightning_ckguard


def _public_members(obj: type) -> dict[str, object]:
    """Every public method and property the package itself defines for ``obj``, along its MRO (the mixin behind
    ``FiniteGradCheckpoint`` included; what ``ModelCheckpoint`` and other packages' bases define is theirs)."""
    found: dict[str, object] = {}
    for cls in reversed(obj.__mro__):
        if not cls.__module__.startswith("lightning_ckguard"):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and (
                inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod))
            ):
                found[name] = value
    return found


def _own_doc(value: object) -> str | None:
    """The member's own docstring: ``inspect.getdoc`` would lend it the one of the method it overrides."""
    target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return getattr(target, "__doc__", None)


@pytest.mark.parametrize("name", lightning_ckguard.__all__)
def test_public_objects_and_their_members_are_documented(name):
    obj = getattr(lightning_ckguard, name)
    assert inspect.getdoc(obj), f"{name} has no docstring"
    if inspect.isclass(obj):
        undocumented = sorted(member for member, value in _public_members(obj).items() if not _own_doc(value))
        assert not undocumented, f"{name}: {undocumented}"


def test_the_walk_sees_the_callbacks_hooks():
    members = _public_members(lightning_ckguard.FiniteGradCheckpoint)
    assert {"setup", "on_validation_end", "state_dict", "admit_save"} <= set(members)


def test_pydoc_renders_the_package():
    text = pydoc.render_doc(lightning_ckguard, renderer=pydoc.plaintext)
    assert "FiniteGradCheckpoint" in text and "NonFiniteGradientError" in text
