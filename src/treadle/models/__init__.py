"""Model clients: the OpenAI-compatible and Anthropic Messages streaming clients.

See docs/design.md.
"""

from typing import TYPE_CHECKING

from treadle._lazy import lazy_names
from treadle.models._context import UsageObserver as UsageObserver
from treadle.models._context import attempt_deadlines as attempt_deadlines
from treadle.models._context import current_deadlines as current_deadlines
from treadle.models._context import observe_usage as observe_usage
from treadle.models._context import report_usage as report_usage

if TYPE_CHECKING:  # loaded on first use (`__getattr__`): they import httpx
    from treadle.models._accumulate import parse_retry_after as parse_retry_after
    from treadle.models._probe import probe as probe
    from treadle.models._sse import SSEDecodeError as SSEDecodeError
    from treadle.models._sse import SSEDecoder as SSEDecoder
    from treadle.models._sse import SSEEvent as SSEEvent
    from treadle.models.anthropic import AnthropicMessagesClient as AnthropicMessagesClient
    from treadle.models.openai import ImageSource as ImageSource
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
        "ImageSource": "treadle.models.openai",
        "OpenAIChatClient": "treadle.models.openai",
    },
)

__all__ = [
    "AnthropicMessagesClient",
    "ImageSource",
    "OpenAIChatClient",
    "SSEDecodeError",
    "SSEDecoder",
    "SSEEvent",
    "UsageObserver",
    "attempt_deadlines",
    "current_deadlines",
    "observe_usage",
    "parse_retry_after",
    "probe",
    "report_usage",
]
