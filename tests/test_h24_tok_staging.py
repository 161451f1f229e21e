"""A policy refused because one of its hf tokenizers does not load changes nothing: the
tokenizers it did load are not installed. They were, one by one as they loaded, so a pool
of the policy still in force on a directory changed in place already served the refused
policy's tokenizer (the reviewer's finding on 6b78af4)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from cachecore.tokenizer import export_builtin
from gateway.tokenization import TokenizerPools
from policies.schema import parse_policy_text

pytestmark = pytest.mark.timeout(60)


def _models(default_dir: Path, other_dir: Path | None = None) -> str:
    text = f"models:\n  default: {{tokenizer: hf, tokenizer_dir: '{default_dir}'}}\n"
    if other_dir is not None:
        text += f"  pools:\n    other: {{tokenizer: hf, tokenizer_dir: '{other_dir}'}}\n"
    return text


async def test_a_refused_policy_installs_none_of_its_tokenizers(tmp_path: Path) -> None:
    shared, bad = tmp_path / "shared", tmp_path / "bad"
    export_builtin(shared)
    export_builtin(bad)
    async with httpx.AsyncClient() as client:
        pools = TokenizerPools(client, lambda _m, _t: None)
        in_force = parse_policy_text(_models(shared))
        assert await pools.load_hf(in_force.models) == []
        before = pools.local(in_force.models.default)
        # the shared directory changed in place (a newer file), the other one cut short
        tok = shared / "tokenizer.json"
        tok.write_bytes(tok.read_bytes() + b"\n")
        cut = bad / "tokenizer.json"
        cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 2])
        refused = parse_policy_text(_models(shared, bad))
        problems = await pools.load_hf(refused.models)
        assert problems and problems[0][0] == "models.pools.other.tokenizer_dir"
        assert pools.local(in_force.models.default) is before  # before: the new file's
        # accepted later (the cut file repaired), the changed directory is read again
        export_builtin(bad)
        assert await pools.load_hf(refused.models) == []
        assert pools.local(in_force.models.default) is not before
