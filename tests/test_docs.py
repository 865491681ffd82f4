"""Every public object has a docstring, and the package's help renders (``pydoc``)."""

from __future__ import annotations

import inspect
import pydoc

import pytest

import lightning_ckguard


def _public_members(obj: type) -> list[tuple[str, object]]:
    return [(name, value) for name, value in vars(obj).items() if not name.startswith("_")
            and (inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod)))]


@pytest.mark.parametrize("name", lightning_ckguard.__all__)
def test_public_objects_and_their_members_are_documented(name):
    obj = getattr(lightning_ckguard, name)
    assert inspect.getdoc(obj), f"{name} has no docstring"
    if inspect.isclass(obj):
        undocumented = [member for member, _ in _public_members(obj) if not inspect.getdoc(getattr(obj, member))]
        assert not undocumented, f"{name}: {undocumented}"


def test_pydoc_renders_the_package():
    text = pydoc.render_doc(lightning_ckguard, renderer=pydoc.plaintext)
    assert "FiniteGradCheckpoint" in text and "NonFiniteGradientError" in text
