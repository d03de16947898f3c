"""Model clients (DESIGN §2): the OpenAI-compatible streaming client and its building blocks."""

from treadle.models._accumulate import parse_retry_after as parse_retry_after
from treadle.models._probe import probe as probe
from treadle.models._sse import SSEDecodeError as SSEDecodeError
from treadle.models._sse import SSEDecoder as SSEDecoder
from treadle.models._sse import SSEEvent as SSEEvent
from treadle.models.openai import ImageSource as ImageSource
from treadle.models.openai import OpenAIChatClient as OpenAIChatClient

__all__ = [
    "ImageSource",
    "OpenAIChatClient",
    "SSEDecodeError",
    "SSEDecoder",
    "SSEEvent",
    "parse_retry_after",
    "probe",
]
