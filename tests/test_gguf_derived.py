"""worker/gguf_derived.py's keeping of a GGUF's tokenizer and config: made once, read back after, made
again where the copy is damaged, and made every time (with a warning) where it cannot be kept."""
from __future__ import annotations

import logging
import os

from worker import gguf_derived
from worker.model_loader import PACKAGED_FILE, packaged_model_dir

PATH = os.path.join(packaged_model_dir(), PACKAGED_FILE)
TEXT = "Once upon a time, a fox"


def test_kept_once_read_back_and_a_damaged_copy_made_again(tmp_path, caplog):
    first = gguf_derived.read(PATH, str(tmp_path))
    [kept] = [p for p in tmp_path.iterdir()]  # one directory, nothing left half-written beside it
    assert kept.name.startswith("gguf-") and (kept / gguf_derived.CONFIG_FILE).is_file()
    made = (kept / "tokenizer.json").stat().st_mtime_ns
    again = gguf_derived.read(PATH, str(tmp_path))  # read back, not made again
    assert (kept / "tokenizer.json").stat().st_mtime_ns == made
    assert again.config.to_dict() == first.config.to_dict()
    assert again.tokenizer(TEXT).input_ids == first.tokenizer(TEXT).input_ids

    (kept / gguf_derived.CONFIG_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="worker.gguf_derived"):
        mended = gguf_derived.read(PATH, str(tmp_path))
    assert "unreadable" in caplog.text and mended.config.to_dict() == first.config.to_dict()
    gguf_derived.read(PATH, str(tmp_path))  # and kept again
    assert (kept / gguf_derived.CONFIG_FILE).read_text().startswith("{\n")


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_start(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="worker.gguf_derived"):
        derived = gguf_derived.read(PATH, str(blocked))
    assert derived.config.model_type == "llama" and derived.tokenizer(TEXT).input_ids
    assert caplog.text.count("made again at every start") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
