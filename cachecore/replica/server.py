"""One simulated replica: engine core + real-time driver + KV-event publisher + metrics,
and the FastAPI app that serves them (:mod:`cachecore.replica.app`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import zmq.asyncio

from cachecore.engine import EngineCore
from cachecore.replica.driver import EngineDriver
from cachecore.replica.events import KVEventPublisher
from cachecore.replica.metrics import ReplicaMetrics
from cachecore.replica.responses import ResponseStore
from cachecore.replica.settings import (
    ReplicaEndpoints,
    ReplicaPorts,
    ReplicaSettings,
    endpoints_for,
    load_score_template,
)
from cachecore.tokenizer import HFTokenizer, ScoreTemplate

logger = logging.getLogger(__name__)


class TokenText:
    """Token id -> text, memoised (outputs are single-token words, decoded one at a time)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> str:
        cache = self._cache
        out = []
        for t in ids:
            s = cache.get(t)
            if s is None:
                s = cache[t] = self._tok.decode([t])
            out.append(s)
        return "".join(out)


class SimReplica:
    """A simulated vLLM replica. The publisher (its sockets) outlives simulated restarts;
    the engine, driver and metrics are rebuilt by :meth:`restart`."""

    def __init__(
        self,
        index: int,
        settings: ReplicaSettings,
        ports: ReplicaPorts,
        tokenizer: HFTokenizer,
        zmq_ctx: zmq.asyncio.Context,
        token_text: TokenText | None = None,
        output_vocab: Sequence[int] | None = None,
        dp_rank: int | None = None,
        score_template: ScoreTemplate | None = None,
    ) -> None:
        """``dp_rank``: this is one engine core of a data-parallel replica (its batches
        carry the rank; :mod:`cachecore.replica.dp` serves the cores on one port).
        ``score_template``: the settings' one, loaded (a fleet loads it once for all its
        replicas); not given, loaded here."""
        self.index = index
        self.settings = settings
        self.ports = ports
        self.dp_rank = dp_rank
        self.endpoints: ReplicaEndpoints = endpoints_for(settings, index, ports, dp_rank)
        self.tokenizer = tokenizer
        self.token_text = token_text or TokenText(tokenizer)
        self.output_vocab = tuple(output_vocab or tokenizer.word_vocabulary.ids)
        self.tokenizer_path = settings.tokenizer_dir or tokenizer.name
        # each /score and /rerank pair's template, as a vLLM cross-encoder's --chat-template
        if score_template is None and settings.score_template:
            score_template = load_score_template(settings.score_template)
        self.score_template = score_template
        # vLLM's --default-chat-template-kwargs and --reasoning-effort-map, under every chat
        self.chat_defaults = settings.chat_defaults()
        self.model = settings.model
        self.served_models: tuple[str, ...] = (settings.model, *settings.lora)
        self.healthy = True
        self.publisher: KVEventPublisher | None = None
        if settings.publish_events:
            self.publisher = KVEventPublisher(
                zmq_ctx,
                f"tcp://{settings.events_host}:{ports.events}",
                f"tcp://{settings.events_host}:{ports.replay}",
                topic=settings.events_topic,
                encoding=settings.event_encoding,
                buffer_steps=settings.replay_buffer_steps,
                legacy_replay_reply=settings.legacy_replay_reply,
                data_parallel_rank=dp_rank,
            )
        self.num_restarts = 0
        self._build_engine()

    def _build_engine(self) -> None:
        self.start_time = time.time()
        # the Responses API's store lives in the engine process's memory (vLLM's): a
        # restart loses it
        self.responses = ResponseStore(self.settings.responses_store_max)
        self.core = EngineCore(self.settings.engine_config(), self.output_vocab)
        self.metrics = ReplicaMetrics(self.model, lambda: self.core, self.start_time)
        self.driver = EngineDriver(
            self.core,
            self.metrics,
            self.publisher,
            self.settings.time_scale,
            name=f"{self.index}",
        )

    async def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self.driver.start()

    async def stop(self) -> None:
        await self.driver.stop("replica shutting down")
        if self.publisher is not None:
            await self.publisher.close()

    async def restart(self) -> None:
        """Simulate an engine process restart: in-flight requests fail, the cache is empty,
        event seq restarts at 0 (replay buffer emptied), a new process_start_time and,
        unless --hash-seed fixed it, a new hash seed."""
        await self.driver.stop("engine restarted")
        if self.publisher is not None:
            self.publisher.reset()
        self.num_restarts += 1
        self._build_engine()
        self.driver.start()
        logger.info(
            "replica restarted",
            extra={"replica": self.index, "process_start_time": self.start_time},
        )

    def load(self) -> dict[str, int]:
        """Its core's load in SGLang's ``/get_load`` shape (one entry per core)."""
        core = self.core
        return {
            "dp_rank": self.dp_rank or 0,
            "num_reqs": len(core.running) + len(core.waiting),
            "num_waiting_reqs": len(core.waiting),
            "num_tokens": core.num_tokens_in_flight(),
        }

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the base model). Raises
        KeyError for a model this replica does not serve."""
        if not name or name == self.model:
            return None
        if name in self.served_models:
            return name
        raise KeyError(name)
