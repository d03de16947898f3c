"""Model clients: the OpenAI-compatible and Anthropic Messages streaming clients.

See docs/design.md.
"""

from treadle.models._accumulate import parse_retry_after as parse_retry_after
from treadle.models._probe import probe as probe
from treadle.models._sse import SSEDecodeError as SSEDecodeError
from treadle.models._sse import SSEDecoder as SSEDecoder
from treadle.models._sse import SSEEvent as SSEEvent
from treadle.models._transport import UsageObserver as UsageObserver
from treadle.models._transport import attempt_deadlines as attempt_deadlines
from treadle.models._transport import current_deadlines as current_deadlines
from treadle.models._transport import observe_usage as observe_usage
from treadle.models._transport import report_usage as report_usage
from treadle.models.anthropic import AnthropicMessagesClient as AnthropicMessagesClient
from treadle.models.openai import ImageSource as ImageSource
from treadle.models.openai import OpenAIChatClient as OpenAIChatClient

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
