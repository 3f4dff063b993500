"""What each backend can really hold, discovered from the engines themselves, and the limit a request must fit.

Every backend is read on `upstream.capacity_refresh_s` (and when it comes back from down): its window and its KV
cache, as its kind tells them (engines.py). The incident this project exists for was a window advertised above the
KV capacity; both numbers are read, exposed as metrics, and the mismatch is logged.

A disaggregated backend is a router in front of prefill and decode engines. The router advertises the window and
holds no KV, so the engines that hold it are declared as the backend's `stages` and read on the same interval:
a prompt must fit the smallest prefill stage's KV cache (the incident's pool), prompt + output the smallest decode
stage's. A stage that has never been read leaves its backend's limit unknown, and the model's requests are refused
503 capacity_unknown: never the window. One that stops answering keeps the number it last gave
(`upstream.on_stage_unread: last_known`, and /readyz names it) or refuses as if never read (`refuse`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from gateway.errors import CapacityUnknown
from gateway.metrics import GatewayMetrics
from gateway.settings import BackendSettings, EngineKind, ModelSettings, StageSettings, TenantSettings, UpstreamSettings
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.engines import Holds, read_holds

log = logging.getLogger("bulkhead.capacity")


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens (prompt + output) one request may use, and what sets that number; `prompt`: a tighter bound
    on the prompt alone, when one is known (a prefill stage's KV cache holds the prompt, not the output)."""

    tokens: int
    source: str
    reason: str
    prompt: PromptLimit | None = None
    setter: str = ""  # "backend/stage" when a stage sets it, for /admin/capacity and its metric

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt admitted (with one token of output)."""
        return min(self.tokens - 1, self.prompt.tokens) if self.prompt is not None else self.tokens - 1


@dataclass
class StageView:
    """One stage, as last read."""

    backend: str
    settings: StageSettings
    holds: Holds = Holds()
    readable: bool = False  # the last read gave its KV cache
    problem: str = "not read yet"
    read_at: float | None = None  # wall-clock time of the last read that gave its KV cache

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.settings.name}"


@dataclass
class BackendView:
    settings: BackendSettings
    holds: Holds = Holds()
    stages: list[StageView] = field(default_factory=list)


class CapacityMonitor:
    def __init__(
        self,
        models: Iterable[ModelSettings],
        backends: Iterable[BackendSettings],
        pool: ReplicaPool,
        metrics: GatewayMetrics,
        upstream: UpstreamSettings,
    ) -> None:
        self._models = list(models)
        self._pool = pool
        self._metrics = metrics
        self._refuse_unread = upstream.on_stage_unread == "refuse"
        self.backends = {
            b.name: BackendView(b, stages=[StageView(b.name, stage) for stage in b.stages]) for b in backends
        }
        # Per model (by identity, the object kept beside its limit): what the reads and its settings allow, or why
        # that is not known.
        self._limits: dict[int, tuple[ModelSettings, PromptLimit | str | None]] = {}
        self._refreshing: set[asyncio.Task[None]] = set()
        for view in self.backends.values():
            for stage in view.stages:
                self._publish_stage(stage)

    async def refresh(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        view = self.backends.get(replica.name)
        if view is None:
            return
        models = [m.name for m in self._models if replica.name in m.backends]
        settings = view.settings
        reads = [self._read_backend(client, view, models, timeout)]
        reads += [self._read_stage(client, view, stage, models, timeout) for stage in view.stages]
        await asyncio.gather(*reads)
        self._limits.clear()
        self._check_models()
        if view.holds.max_model_len is not None:
            self._metrics.backend_max_model_len.labels(settings.name).set(view.holds.max_model_len)
        if view.holds.kv_tokens is not None:
            self._metrics.backend_kv_capacity.labels(settings.name).set(view.holds.kv_tokens)

    async def _read(
        self,
        client: httpx.AsyncClient,
        what: str,
        kind: EngineKind,
        url: str,
        key: str | None,
        models: list[str],
        timeout: float,
    ) -> Holds | str:
        """A read, or why it failed (in words safe to log and to show an operator)."""
        try:
            return await read_holds(client, kind, url, key, models, timeout)
        except httpx.HTTPError as exc:
            log.info("capacity of %s not read: %s", what, type(exc).__name__)
            return f"not read: {type(exc).__name__}"
        except Exception as exc:
            # An engine's garbage must neither stop this watcher (every backend's limits would freeze) nor lift a
            # limit it reported before.
            log.warning("capacity of %s not readable: %s", what, type(exc).__name__)
            return f"not readable: {type(exc).__name__}"

    async def _read_backend(
        self, client: httpx.AsyncClient, view: BackendView, models: list[str], timeout: float
    ) -> None:
        settings = view.settings
        read = await self._read(
            client, f"backend {settings.name}", settings.kind, settings.url, settings.api_key, models, timeout
        )
        if isinstance(read, Holds):
            view.holds = read.over(view.holds)

    async def _read_stage(
        self, client: httpx.AsyncClient, view: BackendView, stage: StageView, models: list[str], timeout: float
    ) -> None:
        settings = view.settings
        kind = settings.stage_kind(stage.settings)
        read = await self._read(
            client, f"stage {stage.label}", kind, stage.settings.url, settings.api_key, models, timeout
        )
        was = stage.readable
        if isinstance(read, str):
            stage.readable, stage.problem = False, read
        elif read.kv_tokens is None:
            # A stage is declared for its KV cache: an answer without it is no read at all.
            stage.holds = read.over(stage.holds)
            stage.readable, stage.problem = False, "answered without its KV cache size"
        else:
            if stage.holds.kv_tokens is not None and read.kv_tokens != stage.holds.kv_tokens:
                log.warning(
                    "stage %s now holds %d KV tokens (was %d)", stage.label, read.kv_tokens, stage.holds.kv_tokens
                )
            stage.holds = read.over(stage.holds)
            stage.readable, stage.problem, stage.read_at = True, "", time.time()
        if was and not stage.readable:
            log.warning("stage %s cannot be read (%s)", stage.label, stage.problem)
        self._publish_stage(stage)

    def _publish_stage(self, stage: StageView) -> None:
        labels = (stage.backend, stage.settings.name, stage.settings.role)
        self._metrics.stage_readable.labels(*labels).set(1 if stage.readable else 0)
        if stage.holds.kv_tokens is not None:
            self._metrics.stage_kv_capacity.labels(*labels).set(stage.holds.kv_tokens)

    async def refresh_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self.refresh(client, r, timeout) for r in self._pool.replicas.values()))

    async def watch(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.refresh_all(client, timeout)

    def refresh_soon(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        """For a backend that just came back: it may have restarted with other limits."""
        task = asyncio.get_running_loop().create_task(self.refresh(client, replica, timeout))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    def kv_tokens(self, backend: str) -> int | None:
        """All the KV cache a backend's answers can come from (a disaggregated one's: every stage's), as last read;
        None when no engine of it said."""
        view = self.backends.get(backend)
        if view is None:
            return None
        held = [view.holds.kv_tokens, *(stage.holds.kv_tokens for stage in view.stages)]
        known = [tokens for tokens in held if tokens is not None]
        return sum(known) if known else None

    def limit(self, model: ModelSettings) -> PromptLimit | None:
        """The model's limit, None when it is not known (for the prober, which has no tenant and need not refuse)."""
        found = self._model_limit(model)
        return found if isinstance(found, PromptLimit) else None

    def require(self, model: ModelSettings, tenant: TenantSettings | None = None) -> PromptLimit:
        """The tightest limit a request to this model (from this tenant) must fit, or CapacityUnknown: nothing is
        forwarded blind."""
        found = self._model_limit(model)
        if not isinstance(found, PromptLimit):
            raise CapacityUnknown(
                f"The capacity of model '{model.name}' is not known "
                + (found or "yet (no context_window configured and no backend has reported its max_model_len)")
                + "; the request was not forwarded."
            )
        cap = tenant.limits.max_prompt_tokens if tenant is not None else None
        if cap is not None and cap < found.tokens:
            prompt = found.prompt if found.prompt is not None and found.prompt.tokens < cap - 1 else None
            return PromptLimit(cap, "this API key's prompt limit", "tenant_cap", prompt)
        return found

    def _model_limit(self, model: ModelSettings) -> PromptLimit | str | None:
        kept = self._limits.get(id(model))
        if kept is None or kept[0] is not model:
            # Kept until the next capacity read: building every candidate's description cost each request ~4 µs.
            kept = self._limits[id(model)] = (model, self._compute(model))
        return kept[1]

    def _compute(self, model: ModelSettings) -> PromptLimit | str | None:
        """The model's limit; or why it is unknown (a sentence's end), or None when nothing has said anything."""
        totals: list[PromptLimit] = []
        prompts: list[PromptLimit] = []
        if model.context_window is not None:
            totals.append(
                PromptLimit(model.context_window, f"the context window of model '{model.name}'", "context_window")
            )
        if model.kv_capacity_tokens is not None:
            totals.append(
                PromptLimit(
                    model.kv_capacity_tokens, f"the configured KV capacity of model '{model.name}'", "kv_capacity"
                )
            )
        for name in model.backends:
            view = self.backends.get(name)
            if view is None:
                continue
            holds = view.holds
            if holds.max_model_len is not None:
                totals.append(PromptLimit(holds.max_model_len, f"max_model_len of backend '{name}'", "max_model_len"))
            if holds.kv_tokens is not None and model.limit_by_kv_capacity:
                totals.append(
                    PromptLimit(holds.kv_tokens, f"the KV cache of backend '{name}' ({holds.kv_detail})", "kv_capacity")
                )
            for stage in view.stages:
                if stage.holds.kv_tokens is None or (self._refuse_unread and not stage.readable):
                    return f"(stage '{stage.settings.name}' of backend '{name}' {stage.problem})"
                # A prefill engine holds the prompt and makes one token (the decode engine makes the rest), a
                # decode engine holds the prompt and the output: each stage's window and KV cache bound its part.
                prefill = stage.settings.role == "prefill"
                bounds = prompts if prefill else totals
                bounds.append(_stage_limit(stage, stage.holds.kv_tokens))
                if stage.holds.max_model_len is not None:
                    where = f"{stage.settings.role} stage '{stage.settings.name}' of backend '{name}'"
                    bounds.append(
                        PromptLimit(
                            stage.holds.max_model_len - 1 if prefill else stage.holds.max_model_len,
                            f"max_model_len of {where}, less the token it makes"
                            if prefill
                            else f"max_model_len of {where}",
                            "max_model_len",
                            setter=stage.label,
                        )
                    )
        if not totals:
            return None
        total = min(totals, key=lambda c: c.tokens)
        prompt = min(prompts, key=lambda c: c.tokens) if prompts else None
        if prompt is not None and prompt.tokens < total.tokens - 1:
            return PromptLimit(total.tokens, total.source, total.reason, prompt, total.setter)
        return total

    def _check_models(self) -> None:
        setters: set[str] = set()
        for model in self._models:
            views = [self.backends[name] for name in model.backends if name in self.backends]
            lengths = [v.holds.max_model_len for v in views if v.holds.max_model_len is not None]
            window = model.context_window or (max(lengths) if lengths else None)
            found = self._compute(model.model_copy(update={"context_window": None}))
            limit = self._model_limit(model)
            if isinstance(limit, PromptLimit):
                self._metrics.model_prompt_limit.labels(model.name).set(limit.prompt_tokens)
            setters |= self.setters(model)
            if window is None:
                continue
            self._metrics.model_context_window.labels(model.name).set(window)
            if not isinstance(found, PromptLimit):
                continue
            tightest = found.prompt or found
            self._metrics.model_capacity.labels(model.name).set(tightest.tokens)
            if window > tightest.tokens:
                log.warning(
                    "model %s advertises a %d-token context window but can hold only %d tokens (%s); "
                    "prompts are limited to %d",
                    model.name,
                    window,
                    tightest.tokens,
                    tightest.source,
                    found.prompt_tokens,
                )
        for view in self.backends.values():
            for stage in view.stages:
                labels = (stage.backend, stage.settings.name, stage.settings.role)
                self._metrics.stage_sets_limit.labels(*labels).set(1 if stage.label in setters else 0)

    def setters(self, model: ModelSettings) -> set[str]:
        """The stages ("backend/stage") that set the model's limit now."""
        limit = self._model_limit(model)
        if not isinstance(limit, PromptLimit):
            return set()
        return {x.setter for x in (limit, limit.prompt) if x is not None and x.setter}

    def unread_stages(self) -> list[StageView]:
        return [stage for view in self.backends.values() for stage in view.stages if not stage.readable]


def _stage_limit(stage: StageView, tokens: int) -> PromptLimit:
    role, name = stage.settings.role, stage.settings.name
    holds = "a prompt" if role == "prefill" else "prompt + output"
    return PromptLimit(
        tokens,
        f"the KV cache of {role} stage '{name}' of backend '{stage.backend}' ({stage.holds.kv_detail}), which holds "
        f"{holds}",
        f"{role}_kv_capacity",
        setter=stage.label,
    )
