"""A tmpfs of a chosen size for the full-disk tests (root mounts it; elsewhere the test
skips with the reason), grown or shrunk in place, and how much of it is used."""

import contextlib
import os
import subprocess

import pytest


def mount(path, size_kb):
  os.makedirs(path, exist_ok=True)
  p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", path],
                     capture_output=True, text=True)
  if p.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs (needs root): {p.stderr.strip()}")
  return path


def remount(path, size_kb):
  subprocess.run(["mount", "-o", f"remount,size={size_kb}k", path], check=True)


def used_kb(path):
  st = os.statvfs(path)
  return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


@contextlib.contextmanager
def tmpfs(path, size_kb):
  mount(path, size_kb)
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)
