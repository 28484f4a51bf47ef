"""host_memory.reuse_freed_memory: inside the block a large freed block is reused without faulting its pages
in again; outside (and after the outermost block closes) glibc maps and faults a fresh one as before; the
model's shared fast-kernel block opens it."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd.cpu import host_memory
from hf_bpd.cpu.host_memory import reuse_freed_memory

BIG = 64 * 1024 * 1024 // 4  # float32s: above glibc's largest mmap threshold (32 MiB), so mapped outside the block
PAGES = 64 * 1024 * 1024 // 4096

needs_glibc = pytest.mark.skipif(host_memory.glibc() is None, reason="malloc settings are glibc's")


def faults_of_a_second_big_block() -> int:
    """Minor page faults taken by filling a big block allocated right after an equal one was freed."""
    torch.empty(BIG).fill_(1.0)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BIG).fill_(2.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def fewest_faults(tries: int = 3) -> int:
    """`faults_of_a_second_big_block` at its lowest over a few tries: a reused block is now and then faulted in
    again by something outside malloc (seen on the dev VMs, whose kernel runs its own memory reclaim, in about
    half of the runs of this file alone), while a fresh mapping faults every page every time."""
    return min(faults_of_a_second_big_block() for _ in range(tries))


def in_a_fresh_process(check: str) -> None:
    """Run `check` (a function of this file) in a new Python process. malloc's settings and heap are the
    process's: a fresh one starts from glibc's own state, whatever the tests before this one allocated."""
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_host_memory as t; t.{check}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_glibc
def test_freed_memory_is_reused_inside_the_block_only():
    in_a_fresh_process("reused_inside_the_block_only")


@needs_glibc
def test_nested_blocks_restore_on_the_outermost_exit():
    in_a_fresh_process("nested_blocks_restore_on_the_outermost_exit")


def reused_inside_the_block_only():
    assert faults_of_a_second_big_block() > PAGES // 2  # a fresh mapping: every page faulted in again
    with reuse_freed_memory():
        faults_of_a_second_big_block()  # the heap grows once
        assert fewest_faults() < PAGES // 10
    assert faults_of_a_second_big_block() > PAGES // 2


def nested_blocks_restore_on_the_outermost_exit():
    with reuse_freed_memory():
        with reuse_freed_memory():
            assert host_memory._depth == 2
        faults_of_a_second_big_block()
        assert fewest_faults() < PAGES // 10  # still on after the inner block closed
    assert host_memory._depth == 0
    assert faults_of_a_second_big_block() > PAGES // 2


def test_fast_cpu_block_opens_it():
    model = tiny_model()
    with hf_bpd.fast_cpu(model):
        assert host_memory._depth == 1
    assert host_memory._depth == 0


def test_starting_value_reads_mallocs_environment(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert host_memory.starting_value(host_memory.M_MMAP_MAX) == 0
    monkeypatch.delenv("MALLOC_MMAP_MAX_")
    assert host_memory.starting_value(host_memory.M_MMAP_MAX) == 65536
