"""R1's E8 (twenty-sixth session): the trace replays say what their length caps cut. The
Azure replays (context 4,096, output 256 tokens) and the Mooncake ones (8,192 / 128) cut
the trace's lengths without a word in the bench's output."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.workloads import TextSource, azure, mooncake


def test_azure_says_its_caps_and_how_many_rows_they_cut(tmp_path: Path) -> None:
    csv = tmp_path / "az.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,5000,10\n"
        "2023-11-16 18:15:47.0000000,100,300\n"
        "2023-11-16 18:15:48.0000000,200,400\n"
    )
    w = azure(TextSource(), "conv", path=csv)
    assert [it.max_tokens for it in w.items] == [10, 256, 256]
    assert w.description == (
        "Azure conv trace, 3 rows; prompts capped at 4096 tokens (1 of 3 rows cut), "
        "outputs at 256 tokens (2 of 3 cut)"
    )
    assert (
        "capped"
        not in azure(
            TextSource(), "conv", path=csv, max_input_tokens=None, output_cap=None
        ).description
    )


def test_mooncake_says_its_caps_and_how_many_rows_they_cut(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 300, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 600, "output_length": 20, "hash_ids": [1, 4]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = mooncake(TextSource(), path=path, max_input_tokens=1024, output_cap=128)
    assert [it.max_tokens for it in w.items] == [128, 20]
    assert w.description.endswith(
        "2 rows; prompts capped at 1024 tokens (1 of 2 rows cut), "
        "outputs at 128 tokens (1 of 2 cut)"
    )
