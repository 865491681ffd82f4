"""System-call traces of real fits, and the durability rule checked on them (test-only).

:func:`traced` attaches ``strace`` to the running process (and, with ``-f``, to every process it starts afterwards:
the ranks Lightning's launcher starts) and records the calls that write, flush, rename, link and remove.
:func:`durability_violations` reads such a trace and returns, for every name published into a directory, what broke
the order a machine crash needs:

- the data of every file published (through any chain of renames: a temporary file, its staging name, the name) was
  flushed (``fsync``/``fdatasync``) after its last write and before it was published; for a directory, every file in
  it and every directory of it too;
- the directory that holds the name was flushed after the publication, and each directory made (``mkdir``) on the way
  to the name (a new ``dirpath``, a subdirectory of a ``filename`` with a ``/``) was flushed in its parent after it was
  made, before the next removal of a visible name.

A publication is a rename (or an exchange) onto a visible name in the directory or one of its subdirectories (not
inside a checkpoint published as a directory), a link made there, or a file written directly in the directory itself.
Hidden names (staging entries, retired copies) are not publications, and removing them is not an eviction.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

SYSCALLS = ("write", "pwrite64", "writev", "pwritev", "pwritev2", "sendfile", "copy_file_range", "ftruncate",
            "fsync", "fdatasync", "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "symlink",
            "symlinkat", "mkdir", "mkdirat")
_WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2", "sendfile", "copy_file_range", "ftruncate"}
_FLUSHES = {"fsync", "fdatasync"}
_RENAMES = {"rename", "renameat", "renameat2"}
_REMOVALS = {"unlink", "unlinkat", "rmdir"}
_LINKS = {"symlink", "symlinkat"}
_MKDIRS = {"mkdir", "mkdirat"}


def have_strace() -> bool:
    return shutil.which("strace") is not None


def _traced_now() -> bool:
    with open("/proc/self/status") as status:
        return any(line.split()[1:] != ["0"] for line in status if line.startswith("TracerPid:"))


@contextmanager
def traced(output: str) -> Iterator[None]:
    """Record the calls of this process, and of every process it starts meanwhile, into ``output``."""
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-y", "-s", "0", "-e", "signal=none", "-e", "trace=" + ",".join(SYSCALLS),
         "-o", output, "-p", str(os.getpid())],
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not _traced_now():
        if tracer.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("strace could not attach")
        time.sleep(0.02)
    time.sleep(0.3)  # the other threads of this process are attached right after the first
    try:
        yield
    finally:
        tracer.send_signal(signal.SIGINT)  # detaches, and writes out what it holds
        tracer.wait(timeout=60)


@dataclass
class Call:
    index: int
    name: str
    descriptors: list[str]  # the paths of the descriptor arguments, in order
    strings: list[str]  # the string arguments, in order
    flags: str
    result: str = ""


_LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(?:<\.\.\. (\w+) resumed>(.*)|(\w+)\((.*))$")
_DESCRIPTOR = re.compile(r"(?:\d+|AT_FDCWD)<((?:[^>\\]|\\.)*)>")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_RESULT = re.compile(r"\)\s+=\s+(.*)$")


def _unescape(text: str) -> str:
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape") if "\\" in text else text


def parse(text: str) -> list[Call]:
    """The calls of a trace, in the order they started; an interrupted call gets its result when it resumes."""
    calls: list[Call] = []
    pending: dict[tuple[str, str], Call] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, resumed_name, resumed_rest, name, rest = match.groups()
        if resumed_name is not None:
            call = pending.pop((pid, resumed_name), None)
            if call is not None:
                call.result = resumed_rest.rsplit("=", 1)[-1].strip()
            continue
        body = rest.split(" <unfinished", 1)[0]
        ended = _RESULT.search(body)
        arguments = body[:ended.start()] if ended else body
        call = Call(len(calls), name, [_unescape(path).removesuffix(" (deleted)") for path in _DESCRIPTOR.findall(
            arguments)], [_unescape(s) for s in _STRING.findall(_DESCRIPTOR.sub("", arguments))], arguments)
        if "<unfinished" in rest:
            pending[(pid, name)] = call
        else:
            call.result = ended.group(1) if ended else ""
        calls.append(call)
    return [call for call in calls if not call.result.startswith("-1") and not call.result.startswith("?")]


def _absolute(base: str | None, path: str) -> str:
    return os.path.normpath(path if os.path.isabs(path) or base is None else os.path.join(base, path))


def _paths_of(call: Call) -> tuple[str, ...]:
    """The paths a rename, removal, link or new directory names: (source, destination), (removed,), (link,) or
    (directory,)."""
    descriptors, strings = list(call.descriptors), call.strings
    if call.name in ("rename", "unlink", "rmdir", "mkdir"):
        return tuple(_absolute(None, s) for s in strings)
    if call.name == "symlink":
        return (_absolute(None, strings[1]),)
    if call.name == "symlinkat":
        return (_absolute(descriptors[0] if descriptors else None, strings[1]),)
    # renameat/renameat2 (dirfd, name, dirfd, name), unlinkat and mkdirat (dirfd, name); AT_FDCWD has a path under -y
    return tuple(_absolute(base, name) for base, name in zip(descriptors, strings, strict=False))


@dataclass
class _Content:
    """What a path holds: its last write, whether a flush followed it, whether it is a link."""

    last_write: int = -1
    flushed: bool = True
    link: bool = False
    tree_changes: list[int] = field(default_factory=list)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _visible_in(path: str, directory: str) -> bool:
    """Whether ``path`` is inside ``directory`` through visible names only (not a staging entry or a retired copy)."""
    if not _under(path, directory) or path == directory:
        return False
    return not any(part.startswith(".") for part in os.path.relpath(path, directory).split(os.sep))


@dataclass
class _Publication:
    """A name published (at call ``index``), and the directories still to flush before the next eviction: per
    directory, what it holds that is not on disk yet ("" for the name itself)."""

    index: int
    name: str
    unflushed: dict[str, str]


_Value = TypeVar("_Value")


def _rename_under(paths: dict[str, _Value], source: str, destination: str, exchange: bool) -> dict[str, _Value]:
    """Move the entries of ``paths`` under ``source`` to under ``destination`` (and back, for an exchange), in place;
    returns the moved ones under their new paths."""
    moved = {path: value for path, value in paths.items() if _under(path, source)}
    exchanged = {path: value for path, value in paths.items() if _under(path, destination)}
    for path in (*moved, *exchanged):
        paths.pop(path, None)
    renamed = {destination + path[len(source):]: value for path, value in moved.items()}
    paths.update(renamed)
    if exchange:
        paths.update({source + path[len(destination):]: value for path, value in exchanged.items()})
    return renamed


class _Checker:
    def __init__(self, directory: str) -> None:
        self.directory = os.path.normpath(directory)
        self.contents: dict[str, _Content] = {}
        self.made: dict[str, int] = {}  # the directories made (mkdir), by the call that made them
        self.published: set[str] = set()
        self.waiting: list[_Publication] = []  # publications with a directory not flushed yet
        self.flushed_directories: dict[str, int] = {}
        self.violations: list[str] = []

    def content(self, path: str) -> _Content:
        return self.contents.setdefault(path, _Content())

    def is_publication(self, path: str) -> bool:
        """Whether a name put at ``path`` is published: visible, and not inside a checkpoint published whole."""
        return _visible_in(path, self.directory) and not any(
            path != name and _under(path, name) for name in self.published)

    def make_directory(self, call: Call) -> None:
        self.made[_paths_of(call)[0]] = call.index

    def write(self, call: Call) -> None:
        target = call.descriptors[-1] if call.name == "copy_file_range" else call.descriptors[0]
        content = self.content(target)
        content.last_write, content.flushed = call.index, False
        if _visible_in(target, self.directory) and os.path.dirname(target) == self.directory:
            self.publish(call.index, target, [(target, content)], written_in_place=True)

    def flush(self, call: Call) -> None:
        path = call.descriptors[0]
        self.content(path).flushed = True
        self.flushed_directories[path] = call.index
        for publication in self.waiting:
            publication.unflushed.pop(path, None)
        self.waiting = [publication for publication in self.waiting if publication.unflushed]

    def rename(self, call: Call) -> None:
        source, destination = _paths_of(call)[:2]
        exchange = "RENAME_EXCHANGE" in call.flags
        moved = _rename_under(self.contents, source, destination, exchange)
        _rename_under(self.made, source, destination, exchange)
        self.publish(call.index, destination, list(moved.items()), directory_source=source)

    def publish(self, index: int, name: str, files: list[tuple[str, _Content]], written_in_place: bool = False,
                directory_source: str | None = None) -> None:
        if not self.is_publication(name):
            return
        for path, content in files:
            if not written_in_place and not content.link and not content.flushed:
                self.violations.append(f"{name}: {path} published (call {index}) without a flush after its last "
                                       f"write (call {content.last_write})")
        if directory_source is not None:
            self.check_directories_flushed(index, name, directory_source, files)
        self.published.add(name)
        unflushed = {os.path.dirname(name): ""}
        for made, at in self.made.items():  # each directory made on the way to the name, in its parent
            if made != name and _under(name, made) and self.flushed_directories.get(os.path.dirname(made), -1) < at:
                unflushed[os.path.dirname(made)] = f" (holding {made}, made at call {at})"
        self.waiting.append(_Publication(index, name, unflushed))

    def check_directories_flushed(self, index: int, name: str, source: str, files: list[tuple[str, _Content]]
                                  ) -> None:
        directories = {os.path.dirname(path) for path, _ in files if path != name}
        for directory in sorted(directories):
            last_change = max(c.last_write for p, c in files if _under(p, directory))
            staged = source + directory[len(name):]
            if self.flushed_directories.get(staged, -1) < last_change:
                self.violations.append(f"{name}: its directory {staged} was not flushed after its last change "
                                       f"(call {last_change}) and before it was published (call {index})")

    def link(self, call: Call) -> None:
        (path,) = _paths_of(call)
        self.content(path).link = True
        self.publish(call.index, path, [])

    def remove(self, call: Call) -> None:
        for path in _paths_of(call):
            for paths in (self.contents, self.made):
                for gone in [p for p in paths if _under(p, path)]:
                    del paths[gone]
            self.published = {name for name in self.published if not _under(name, path)}
            if not _visible_in(path, self.directory):
                continue
            for publication in self.waiting:
                for directory, holding in publication.unflushed.items():
                    self.violations.append(f"{publication.name}: published (call {publication.index}) but {path} was "
                                           f"removed (call {call.index}) before the directory was flushed: "
                                           f"{directory}{holding}")
            self.waiting = []

    def finish(self) -> list[str]:
        for publication in self.waiting:
            for directory, holding in publication.unflushed.items():
                self.violations.append(f"{publication.name}: published (call {publication.index}); its directory "
                                       f"{directory}{holding} was never flushed after it")
        return self.violations


def durability_violations(calls: list[Call], directory: str) -> list[str]:
    """Every break of the durability rule (module docstring) for the names published into ``directory``."""
    checker = _Checker(directory)
    handlers = {**dict.fromkeys(_WRITES, checker.write), **dict.fromkeys(_FLUSHES, checker.flush),
                **dict.fromkeys(_RENAMES, checker.rename), **dict.fromkeys(_REMOVALS, checker.remove),
                **dict.fromkeys(_LINKS, checker.link), **dict.fromkeys(_MKDIRS, checker.make_directory)}
    for call in calls:
        handler = handlers.get(call.name)
        if handler is not None and (call.descriptors or call.strings):
            handler(call)
    return checker.finish()


def publications(calls: list[Call], directory: str) -> list[str]:
    """The names published into ``directory`` or its subdirectories (a rename, an exchange or a link onto a visible
    name, not inside a checkpoint published whole), in order, relative to ``directory``."""
    directory = os.path.normpath(directory)
    names: list[str] = []
    for call in calls:
        if call.name in _RENAMES | _LINKS:
            path = _paths_of(call)[-1]
            inside = any(_under(path, os.path.join(directory, name)) and path != os.path.join(directory, name)
                         for name in names)
            if _visible_in(path, directory) and not inside:
                names.append(os.path.relpath(path, directory))
    return names


def flushes_under(calls: list[Call], directory: str) -> list[str]:
    """Every path under ``directory`` (itself included) that was flushed."""
    directory = os.path.normpath(directory)
    return [call.descriptors[0] for call in calls
            if call.name in _FLUSHES and call.descriptors and _under(call.descriptors[0], directory)]
