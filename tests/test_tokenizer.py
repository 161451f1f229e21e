"""The built-in tokenizer's long-text path: the same ids as the short path, and the Rust
work runs without the GIL, so a worker thread encoding a long prompt leaves the event loop
(the main thread) free."""

from __future__ import annotations

import threading
import time

from cachecore.tokenizer import UNLOCKED_ENCODE_CHARS, builtin_tokenizer


def _long_text(words: int) -> str:
    return " ".join(f"word{i} lorem ipsum dolor" for i in range(words))


def test_long_and_short_paths_give_the_same_ids() -> None:
    tok = builtin_tokenizer()
    text = _long_text(400)
    assert len(text) >= UNLOCKED_ENCODE_CHARS
    # the short path on pieces under the threshold, joined, must equal the long path
    # (word boundaries: the pieces split on spaces the tokenizer would split on anyway)
    direct = list(tok._tok.encode(text, add_special_tokens=False).ids)
    assert tok.encode(text) == direct
    short = "hello world, a short one"
    assert tok.encode(short) == list(tok._tok.encode(short, add_special_tokens=False).ids)


def test_a_long_encode_on_a_thread_does_not_hold_the_gil() -> None:
    tok = builtin_tokenizer()
    text = _long_text(4000)
    t0 = time.perf_counter()
    tok.encode(text)
    alone = time.perf_counter() - t0  # tens of ms

    done = threading.Event()

    def work() -> None:
        tok.encode(text)
        done.set()

    worker = threading.Thread(target=work)
    gaps: list[float] = []
    last = time.perf_counter()
    worker.start()
    while not done.is_set():  # the main thread's progress while the worker encodes
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.0005)
    worker.join()
    # holding the GIL, the worker would stall this loop for the whole encode; released, the
    # longest stall is the GIL hand-back at the end (building the id list), a few ms
    assert max(gaps) < 0.5 * alone, (max(gaps), alone)
