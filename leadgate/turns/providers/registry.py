"""Model providers by configured name (``[models.NAME]``)."""

from __future__ import annotations

import logging

from leadgate.core.config import Settings
from leadgate.core.errors import ModelError, quoted
from leadgate.core.logs import loggable
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.script import ScriptProvider

log = logging.getLogger("leadgate.providers")


def build_providers(settings: Settings) -> dict[str, Provider]:
    """One provider per ``[models.NAME]`` section."""
    providers: dict[str, Provider] = {}
    for name, model in settings.models.items():
        if model.provider == "script":
            providers[name] = ScriptProvider()
        else:
            # Imported here: the openai SDK was a sixth of the service's import time
            # (``python -X importtime``), and a service whose models are all ``script``
            # (the demo, the test suite) never uses it.
            from leadgate.turns.providers.openai import OpenAIProvider

            providers[name] = OpenAIProvider(
                base_url=model.base_url,
                api_key=model.api_key,
                model=model.model,
                timeout_s=model.timeout_s,
            )
    return providers


class ProviderRegistry:
    """Model providers by configured name."""

    def __init__(self, providers: dict[str, Provider]) -> None:
        self._providers = providers

    @property
    def names(self) -> frozenset[str]:
        """Configured model names."""
        return frozenset(self._providers)

    def get(self, name: str) -> Provider:
        """The provider for ``name`` (ModelError when the config lost it)."""
        try:
            return self._providers[name]
        except KeyError:
            raise ModelError(
                f"model {quoted(name)} is not configured", rule="model.unknown"
            ) from None

    async def close(self) -> None:
        """Close every provider that holds connections (best effort, logged)."""
        for name, provider in self._providers.items():
            close = getattr(provider, "close", None)
            if close is None:
                continue
            try:
                await close()
            except Exception as exc:
                log.error("closing model provider %s failed", name, exc_info=loggable(exc))
