"""The allocator a benchmark reports (tetris_hf/tools/allocator.py): read from a process's memory map, and tcmalloc,
preloaded, seen as loaded by a real process (and its children: a vLLM worker inherits it)."""

import os
import subprocess
import sys

import pytest

from tetris_hf.tools.allocator import allocator_note, find_tcmalloc, loaded_allocator


@pytest.mark.parametrize("line, expected", [
    ("7f00 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
    ("7f00 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
    ("7f00 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6", "glibc malloc"),
])
def test_loaded_allocator_reads_the_memory_map(tmp_path, line, expected):
    maps = tmp_path / "maps"
    maps.write_text("5600 r--p 00000000 08:01 2 /usr/bin/python3.11\n" + line + "\n")
    assert loaded_allocator(maps) == expected


def test_an_unreadable_map_is_unknown(tmp_path):
    assert loaded_allocator(tmp_path / "absent") == "unknown"


def test_find_tcmalloc_looks_in_the_folders_given(tmp_path):
    assert find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == tmp_path / "libtcmalloc.so.4"
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path),)) == tmp_path / "libtcmalloc_minimal.so.4"  # (the minimal one first)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="no /proc (not Linux)")
def test_this_process_and_a_preloaded_one():
    code = "from tetris_hf.tools.allocator import loaded_allocator, allocator_note; print(loaded_allocator()); " \
           "print(allocator_note(loaded_allocator()))"
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.splitlines()[0] == "glibc malloc"
    assert "glibc malloc" in plain.stdout.splitlines()[1]
    path = find_tcmalloc()
    if path is None:
        pytest.skip("no tcmalloc installed (scripts/setup.sh installs libtcmalloc-minimal4 where it can)")
    preloaded = subprocess.run([sys.executable, "-c", code], env={**env, "LD_PRELOAD": str(path)},
                               capture_output=True, text=True, check=True)
    first, note = preloaded.stdout.splitlines()[:2]
    assert first == "tcmalloc" and str(path) in note
    # a child process (a vLLM worker) started with this environment runs under it too
    child = subprocess.run([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                            f"{code!r}])"], env={**env, "LD_PRELOAD": str(path)}, capture_output=True, text=True,
                           check=True)
    assert child.stdout.splitlines()[0] == "tcmalloc"
    assert allocator_note(loaded_allocator()).startswith("memory allocator:")
