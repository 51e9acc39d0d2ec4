"""resolve_model builds each config once and hands out copies; an edited config.json is read again."""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import BertConfig

from memfit.models.registry import resolve_model


def test_a_config_file_edited_is_read_again_and_copies_stay_apart(tmp_path: Path) -> None:
    BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path)
    resolve_model(str(tmp_path))  # built, and kept
    again = resolve_model(str(tmp_path))  # the one kept
    again.config.num_hidden_layers = 7  # a caller's change stays in its own copy
    assert resolve_model(str(tmp_path)).config.num_hidden_layers == 2
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["num_hidden_layers"] = 3
    path.write_text(json.dumps(data))
    # a modification time of its own even where the file system's clock is coarse
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model(str(tmp_path)).config.num_hidden_layers == 3
    assert resolve_model(str(path)).config.num_hidden_layers == 3


def test_a_registry_config_is_equal_each_time() -> None:
    one, two, three = resolve_model("gpt2"), resolve_model("gpt2"), resolve_model("gpt2")
    assert one.config is not two.config and two.config is not three.config
    assert one.config.to_json_string() == two.config.to_json_string()
    assert one.cache_key() == two.cache_key()
