"""Embedded corpus: file selection, split, cap, sampler state, validation batches, BPB."""

import math
import sysconfig

import numpy as np
import pytest

from experiments import data


@pytest.fixture(scope="module")
def corpus():
  return data.load_corpus()


def test_file_selection_is_sorted_and_skips_third_party_and_tests():
  files = data.stdlib_files()
  assert files == sorted(files) and len(files) > 100
  for rel in files:
    assert rel.endswith(".py")
    assert not set(rel.split("/")[:-1]) & data.SKIPPED_DIRS, rel


def test_split_by_file_and_cap(corpus):
  assert set(corpus.train_files).isdisjoint(corpus.validation_files)
  assert all(data.is_validation_file(f) for f in corpus.validation_files)
  assert not any(data.is_validation_file(f) for f in corpus.train_files)
  total = corpus.train.size + corpus.validation.size
  assert total <= data.DEFAULT_MAX_BYTES
  # The cap takes a prefix of the sorted file list.
  n = len(corpus.train_files) + len(corpus.validation_files)
  assert sorted(corpus.train_files + corpus.validation_files) == data.stdlib_files()[:n]
  assert 0.03 < corpus.validation.size / total < 0.3
  assert corpus.train.dtype == np.uint8
  root = sysconfig.get_paths()["stdlib"]
  with open(f"{root}/{corpus.train_files[0]}", "rb") as f:
    head = f.read()
  assert corpus.train[:len(head)].tobytes() == head


def test_load_is_deterministic(corpus):
  again = data.load_corpus.__wrapped__()  # bypass the in-memory cache
  assert again.sha256 == corpus.sha256
  np.testing.assert_array_equal(again.validation, corpus.validation)
  small = data.load_corpus(1_000_000)
  assert small.train.size + small.validation.size <= 1_000_000
  with pytest.raises(ValueError, match="max_bytes"):
    data.load_corpus(0)


def test_sampler_is_a_pure_function_of_its_state(corpus):
  s0 = data.init_sampler(7)
  a, s1 = data.sample_batch(corpus.train, s0, 4, 16)
  b, s2 = data.sample_batch(corpus.train, s1, 4, 16)
  assert a.shape == (4, 17) and a.dtype == np.int32 and s2 == data.SamplerState(7, 2)
  assert not np.array_equal(a, b)
  # Resuming from a saved state replays the same stream.
  b_again, _ = data.sample_batch(corpus.train, data.SamplerState(*map(int, s1)), 4, 16)
  np.testing.assert_array_equal(b, b_again)
  other, _ = data.sample_batch(corpus.train, data.init_sampler(8), 4, 16)
  assert not np.array_equal(a, other)
  # Each row is a contiguous window of the training bytes.
  text = corpus.train.tobytes()
  for row in a:
    assert bytes(row.astype(np.uint8)) in text
  with pytest.raises(ValueError, match="seq="):
    data.sample_batch(corpus.train, s0, 1, corpus.train.size)


def test_validation_batches_are_fixed(corpus):
  v = data.validation_batches(corpus.validation, 3, 2, 16)
  assert v.shape == (3, 2, 17) and v.dtype == np.int32
  np.testing.assert_array_equal(v, data.validation_batches(corpus.validation, 3, 2, 16))
  assert v[0, 0].tolist() == corpus.validation[:17].tolist()
  assert v[-1, -1].tolist() == corpus.validation[-17:].tolist()


def test_bits_per_byte():
  assert data.bits_per_byte(math.log(256.0)) == pytest.approx(8.0, abs=1e-12)
  assert data.bits_per_byte(math.log(2.0)) == pytest.approx(1.0, abs=1e-12)
