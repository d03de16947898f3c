"""The five actors of a run, their messages and their inboxes (docs/design.md, "The five actors").

Everything a replacement actor, a fake or a test needs is here; the modules behind it are
private. Each actor is a trio task serving one inbox (a mailbox, `open_mailbox`):

* `RunCoordinator`: the state machine, the step loop, stop rules and budgets; its inbox takes
  `Control` messages (`Cancel`, `Offer`, `Drain`);
* `ContextHydrator`: answers `Hydrate` with the next `treadle.types.ModelRequest` (or a
  `Compaction`);
* `ModelGateway`: answers `CallModel` with a `ModelOutcome`;
* `ToolExecutor`: answers `RunActions` with an `ActionsOutcome`;
* `EventWriter`: the run's single writer to its store, serving `WriterRequest` messages that
  the other actors send through a `WriterClient`.

A request that wants an answer carries a `ReplySlot` (`request` sends and waits, `reply`
answers). The step's cancellation and active-time deadline is a `StepScope`, the one object
the actors of a step share. `Parked`, `AwaitingChildren` and `Drained` are the coordinator's
signals that the run stops being driven here (caught by the run supervisor). `backoff_s` and
`ends_the_call` are the retry rule of model attempts, shared by the gateway and the
coordinator's resume. `read_chain` reads the history a run inherits from the runs it
continues (a `Chain`, each log once), the reading the hydrator and the check before a thread's
new run share (`read_continued` reads one of those logs, for a run that continues it);
`recorded_history` turns one into messages (docs/threads.md).
"""

from treadle._state import seconds_between as seconds_between
from treadle.actors._coordinator import STOP_GRACE_S as STOP_GRACE_S
from treadle.actors._coordinator import AwaitingChildren as AwaitingChildren
from treadle.actors._coordinator import Drained as Drained
from treadle.actors._coordinator import Parked as Parked
from treadle.actors._coordinator import RunCoordinator as RunCoordinator
from treadle.actors._executor import ToolExecutor as ToolExecutor
from treadle.actors._gateway import DELTA_FLUSH_CHARS as DELTA_FLUSH_CHARS
from treadle.actors._gateway import DELTA_FLUSH_S as DELTA_FLUSH_S
from treadle.actors._gateway import ModelGateway as ModelGateway
from treadle.actors._history import Chain as Chain
from treadle.actors._history import InheritedRun as InheritedRun
from treadle.actors._history import read_chain as read_chain
from treadle.actors._history import read_continued as read_continued
from treadle.actors._history import recorded_history as recorded_history
from treadle.actors._history import step_messages as step_messages
from treadle.actors._hydrator import ContextHydrator as ContextHydrator
from treadle.actors._mailbox import MailboxReceiver as MailboxReceiver
from treadle.actors._mailbox import MailboxSender as MailboxSender
from treadle.actors._mailbox import open_mailbox as open_mailbox
from treadle.actors._messages import ActionsOutcome as ActionsOutcome
from treadle.actors._messages import Append as Append
from treadle.actors._messages import AwaitedChild as AwaitedChild
from treadle.actors._messages import CallModel as CallModel
from treadle.actors._messages import Cancel as Cancel
from treadle.actors._messages import Compaction as Compaction
from treadle.actors._messages import Control as Control
from treadle.actors._messages import Delta as Delta
from treadle.actors._messages import Drain as Drain
from treadle.actors._messages import Forward as Forward
from treadle.actors._messages import Hydrate as Hydrate
from treadle.actors._messages import KeepDecision as KeepDecision
from treadle.actors._messages import ModelOutcome as ModelOutcome
from treadle.actors._messages import Offer as Offer
from treadle.actors._messages import RunActions as RunActions
from treadle.actors._messages import Subscribe as Subscribe
from treadle.actors._messages import Subscription as Subscription
from treadle.actors._messages import Warn as Warn
from treadle.actors._messages import WriterRequest as WriterRequest
from treadle.actors._messages import take_offer as take_offer
from treadle.actors._retries import backoff_s as backoff_s
from treadle.actors._retries import ends_the_call as ends_the_call
from treadle.actors._rpc import CANCEL_GRACE_S as CANCEL_GRACE_S
from treadle.actors._rpc import ReplySlot as ReplySlot
from treadle.actors._rpc import StepScope as StepScope
from treadle.actors._rpc import reply as reply
from treadle.actors._rpc import request as request
from treadle.actors._writer import SINK_BUFFER as SINK_BUFFER
from treadle.actors._writer import SUBSCRIBER_BUFFER as SUBSCRIBER_BUFFER
from treadle.actors._writer import EventWriter as EventWriter
from treadle.actors._writer import SinkFeed as SinkFeed
from treadle.actors._writer import WriterClient as WriterClient
from treadle.actors._writer import WriterStatistics as WriterStatistics
from treadle.actors._writer import check_from_seq as check_from_seq
from treadle.actors._writer import durable_event as durable_event
from treadle.actors._writer import resume_from as resume_from
from treadle.actors._writer import stored_events as stored_events
from treadle.actors._writer import with_step_started as with_step_started

__all__ = [
    "CANCEL_GRACE_S",
    "DELTA_FLUSH_CHARS",
    "DELTA_FLUSH_S",
    "SINK_BUFFER",
    "STOP_GRACE_S",
    "SUBSCRIBER_BUFFER",
    "ActionsOutcome",
    "Append",
    "AwaitedChild",
    "AwaitingChildren",
    "CallModel",
    "Cancel",
    "Chain",
    "Compaction",
    "ContextHydrator",
    "Control",
    "Delta",
    "Drain",
    "Drained",
    "EventWriter",
    "Forward",
    "Hydrate",
    "InheritedRun",
    "KeepDecision",
    "MailboxReceiver",
    "MailboxSender",
    "ModelGateway",
    "ModelOutcome",
    "Offer",
    "Parked",
    "ReplySlot",
    "RunActions",
    "RunCoordinator",
    "SinkFeed",
    "StepScope",
    "Subscribe",
    "Subscription",
    "ToolExecutor",
    "Warn",
    "WriterClient",
    "WriterRequest",
    "WriterStatistics",
    "backoff_s",
    "check_from_seq",
    "durable_event",
    "ends_the_call",
    "open_mailbox",
    "read_chain",
    "read_continued",
    "recorded_history",
    "reply",
    "request",
    "resume_from",
    "seconds_between",
    "step_messages",
    "stored_events",
    "take_offer",
    "with_step_started",
]
