"""Model clients: the OpenAI-compatible and Anthropic Messages streaming clients.

What a client is handed for each attempt (deadlines, the usage observer of the token budget,
the run's image source) is one `Attempt` record, the ``attempt`` argument of
`treadle.ports.ModelClient.complete` (docs/models.md, "Writing a model client").
"""

from typing import TYPE_CHECKING

from treadle._lazy import lazy_names
from treadle.types import Attempt as Attempt
from treadle.types import ImageSource as ImageSource
from treadle.types import UsageObserver as UsageObserver

if TYPE_CHECKING:  # loaded on first use (`__getattr__`): they import httpx
    from treadle.models._accumulate import parse_retry_after as parse_retry_after
    from treadle.models._probe import probe as probe
    from treadle.models._sse import SSEDecodeError as SSEDecodeError
    from treadle.models._sse import SSEDecoder as SSEDecoder
    from treadle.models._sse import SSEEvent as SSEEvent
    from treadle.models.anthropic import AnthropicMessagesClient as AnthropicMessagesClient
    from treadle.models.openai import OpenAIChatClient as OpenAIChatClient

__getattr__ = lazy_names(
    __name__,
    {
        "parse_retry_after": "treadle.models._accumulate",
        "probe": "treadle.models._probe",
        "SSEDecodeError": "treadle.models._sse",
        "SSEDecoder": "treadle.models._sse",
        "SSEEvent": "treadle.models._sse",
        "AnthropicMessagesClient": "treadle.models.anthropic",
        "OpenAIChatClient": "treadle.models.openai",
    },
)

__all__ = [
    "AnthropicMessagesClient",
    "Attempt",
    "ImageSource",
    "OpenAIChatClient",
    "SSEDecodeError",
    "SSEDecoder",
    "SSEEvent",
    "UsageObserver",
    "parse_retry_after",
    "probe",
]
