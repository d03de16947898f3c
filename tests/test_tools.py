"""Tool declaration (`@tool`), argument schemas and validation, and `Toolbox` execution."""

from __future__ import annotations

import datetime
import enum
import functools
import inspect
import json
import keyword
from collections.abc import Callable
from typing import Any, Literal

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import treadle
from treadle._exceptions import TreadleError, UsageError
from treadle._schema import Invalid, argument_validator
from treadle.ports import ActionExecutor
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import EnvironmentFailure, Tool, Toolbox, ToolContext, tool
from treadle.types import Action, ActionOutcome, ActionResult, ActionStatus, ReplayPolicy


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Grade(enum.Enum):
    LOW = 1
    HIGH = 2


class Shade(str, enum.Enum):  # noqa: UP042 (a str-mixin enum, as StrEnum is not)
    RED = "red"
    BLUE = "blue"


class Size(enum.StrEnum):
    SMALL = "s"
    LARGE = "l"


@attrs.frozen
class Point:
    """A point on the map."""

    x: int
    y: int = 0


@attrs.frozen
class Route:
    name: str
    stops: list[Point]


def action(tool_name: str, arguments: Any = None, **fields: Any) -> Action:
    base: dict[str, Any] = {
        "run_id": "run-1",
        "step": 3,
        "intent_id": "run-1/s3/a1",
        "call_id": "call_1",
        "tool": tool_name,
        "arguments": {} if arguments is None else arguments,
    }
    base.update(fields)
    return Action(**base)


@tool
async def get_weather(city: str, days: int = 1, unit: Literal["C", "F"] = "C") -> str:
    """Get the weather forecast for a city.

    Longer explanation that is not the summary.

    Args:
        city: the city name,
            e.g. "Lyon".
        days: how many days ahead.
    """
    return f"{city}:{days}:{unit}"


# --------------------------------------------------------------------------- declaration


def test_schema_from_signature_and_docstring() -> None:
    spec = get_weather.spec
    assert spec.name == "get_weather"
    assert spec.description == "Get the weather forecast for a city."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": 'the city name, e.g. "Lyon".'},
            "days": {"type": "integer", "description": "how many days ahead.", "default": 1},
            "unit": {"enum": ["C", "F"], "default": "C"},
        },
        "required": ["city"],
        "additionalProperties": False,
    }


async def _summary_a(x: int) -> str:
    """Look up a customer
    by id.
    Args:
        x: the id.
    Returns:
        the customer.
    """
    return ""


async def _summary_b(x: int) -> str:
    """
    Args:
        x: the id.
    """
    return ""


async def _summary_c(x: int) -> str:
    """Returns: the record for x."""
    return ""


async def _summary_d(x: int) -> str:
    """Look up a customer.
    :param x: the id.
    """
    return ""


async def _summary_e(x: int) -> str:
    """Look up.
    Parameters
    ----------
    x : int
        the id
    """
    return ""


@pytest.mark.parametrize(
    ("fn", "description"),
    [
        (_summary_a, "Look up a customer by id."),
        (_summary_b, ""),
        (_summary_c, ""),
        (_summary_d, "Look up a customer."),
        (_summary_e, "Look up."),
    ],
)
def test_a_docstring_section_right_under_the_summary_is_not_described(
    fn: Callable[..., Any], description: str
) -> None:
    """ "Args:" right under the summary (no blank line) landed in the tool's description."""
    assert tool(fn).description == description


async def _notice_warning(path: str) -> str:
    """Warning: irreversible. Deletes the file at path.

    Args:
        path: the file to delete.
    """
    return ""


async def _notice_note(city: str) -> str:
    """Note: this calls a paid API.
    Gets the weather forecast for a city.
    """
    return ""


async def _notice_later(city: str) -> str:
    """Gets the weather forecast for a city.
    Note: this calls a paid API.
    """
    return ""


@pytest.mark.parametrize(
    ("fn", "description"),
    [
        (_notice_warning, "Warning: irreversible. Deletes the file at path."),
        (_notice_note, "Note: this calls a paid API. Gets the weather forecast for a city."),
        (_notice_later, "Gets the weather forecast for a city."),
    ],
)
def test_a_notice_on_the_docstrings_first_line_is_described(
    fn: Callable[..., Any], description: str
) -> None:
    """A first line "Warning: ..." or "Note: ..." was taken as a section: no description."""
    assert tool(fn).description == description


def test_schema_of_rich_types_and_context_left_out() -> None:
    @tool(name="plan", description="Plan a route.")
    async def plan_route(
        route: Route,
        color: Color,
        level: Level,
        note: str | None,
        ctx: ToolContext,
        tags: list[str] | None = None,
        weights: dict[str, float] | None = None,
        fast: bool = False,
    ) -> None:
        return None

    params = plan_route.spec.parameters
    assert plan_route.name == "plan"
    assert plan_route.description == "Plan a route."
    assert set(params["properties"]) == {
        "route",
        "color",
        "level",
        "note",
        "tags",
        "weights",
        "fast",
    }
    assert params["required"] == ["route", "color", "level", "note"]
    assert params["properties"]["route"] == {"$ref": "#/$defs/Route"}
    assert params["$defs"]["Point"]["additionalProperties"] is False
    assert params["$defs"]["Point"]["required"] == ["x"]
    assert params["$defs"]["Route"]["properties"]["stops"] == {
        "type": "array",
        "items": {"$ref": "#/$defs/Point"},
    }
    assert sorted(params["$defs"]["Color"]["enum"]) == ["blue", "red"]
    assert params["properties"]["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert params["properties"]["weights"]["anyOf"][0] == {
        "type": "object",
        "additionalProperties": {"type": "number"},
    }
    assert plan_route.signature.context_parameter == "ctx"


def test_tool_without_parameters_or_docstring() -> None:
    @tool
    async def ping() -> str:
        return "pong"

    assert ping.description == ""
    assert ping.spec.parameters["type"] == "object"
    assert ping.spec.parameters["properties"] == {}
    assert ping.spec.parameters.get("required", []) == []


def test_options_are_kept() -> None:
    async def check(a: Action) -> ActionOutcome | None:
        return None

    @tool(
        replay=ReplayPolicy.SAFE,
        completes_task=True,
        timeout_s=2.5,
        reconcile=check,
        requires_approval=True,
    )
    async def finish(summary: str) -> str:
        return summary

    assert isinstance(finish, Tool)
    assert finish.replay is ReplayPolicy.SAFE
    assert finish.completes_task
    assert finish.timeout_s == 2.5
    assert finish.reconcile is check
    assert finish.requires_approval


async def test_a_tool_can_still_be_called_directly() -> None:
    assert await get_weather("Oslo", days=2) == "Oslo:2:C"


def _sync(city: str) -> str:
    return city


async def _untyped(city) -> str:  # type: ignore[no-untyped-def]
    return str(city)


async def _star_args(*cities: str) -> str:
    return ""


async def _star_kwargs(**cities: str) -> str:
    return ""


async def _positional_only(city: str, /) -> str:
    return city


async def _set_arg(ids: set[int]) -> str:
    return ""


async def _tuple_arg(pair: tuple[int, int]) -> str:
    return ""


async def _any_arg(value: Any) -> str:
    return ""


async def _bare_list(values: list) -> str:  # type: ignore[type-arg]
    return ""


async def _int_keys(values: dict[int, str]) -> str:
    return ""


async def _class_arg(when: datetime.datetime) -> str:
    return ""


async def _float_literal(x: Literal[1.5]) -> str:  # type: ignore[valid-type]
    return ""


async def _unknown_doc(city: str) -> str:
    """Do it.

    Args:
        cty: misspelt.
    """
    return ""


async def _two_contexts(a: ToolContext, b: ToolContext) -> str:
    return ""


async def _private(_city: str) -> str:
    return ""


async def _forward(city: NoSuchType) -> str:  # type: ignore[name-defined]  # noqa: F821
    return ""


@attrs.frozen
class _BadField:
    when: set[int]


async def _bad_attrs(value: _BadField) -> str:
    return ""


@attrs.define
class _Computed:
    total: int
    doubled: int = attrs.field(init=False, default=0)


async def _computed_field(value: _Computed) -> str:  # its schema asked for doubled
    return ""


class _FloatEnum(enum.Enum):
    A = 1.5


async def _float_enum(value: _FloatEnum) -> str:
    return ""


class _MixedEnum(enum.Enum):
    RED = "red"
    ONE = 1


async def _mixed_enum(value: _MixedEnum) -> str:  # refused by msgspec, naming no argument
    return ""


class _EmptyEnum(enum.Enum):
    pass


async def _empty_enum(value: _EmptyEnum) -> str:
    return ""


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_untyped, "has no type annotation"),
        (_star_args, "*cities is not allowed"),
        (_star_kwargs, "**cities is not allowed"),
        (_positional_only, "positional-only"),
        (_set_arg, "unsupported type"),
        (_tuple_arg, "unsupported type"),
        (_any_arg, "unsupported type"),
        (_bare_list, "give the item type"),
        (_int_keys, "keys must be str"),
        (_class_arg, "unsupported type"),
        (_float_literal, "Literal values"),
        (_unknown_doc, "documents unknown arguments: ['cty']"),
        (_two_contexts, "two parameters take the tool context"),
        (_private, "must not start with '_'"),
        (_forward, "cannot resolve the type annotations"),
        (_bad_attrs, "field 'when'"),
        (_float_enum, "enum values must be str or int"),
        (_computed_field, "field 'doubled' of _Computed is init=False"),
    ],
)
def test_bad_declarations_raise_usage_error(fn: Callable[..., Any], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("*", r"\*").replace("[", r"\[")):
        tool(fn)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            _mixed_enum,
            "argument 'value': unsupported type <enum '_MixedEnum'> (enum values must be all "
            "str or all int, not both: 'red', 1)",
        ),
        (_empty_enum, "(an enum needs at least one member)"),
    ],
)
def test_an_enum_the_schema_cannot_list_is_refused_naming_the_argument(
    fn: Callable[..., Any], message: str
) -> None:
    # A mixed enum was refused by the schema generator, naming the tool and no argument.
    with pytest.raises(UsageError) as refused:
        tool(fn)
    assert message in str(refused.value)
    assert "argument 'value'" in str(refused.value)


@attrs.frozen
class _Bounded:
    limit: float = float("inf")


@pytest.mark.parametrize(
    ("annotation", "default", "said"),
    [
        (float, float("inf"), "argument 'x': the default inf has no JSON form"),
        (float, float("nan"), "argument 'x': the default nan has no JSON form"),
        (float | None, -float("inf"), "argument 'x': the default -inf has no JSON form"),
        (list[float], [1.0, float("nan")], "the default [1.0, nan], which holds nan, has no"),
        (dict[str, float], {"a": float("inf")}, "the default {'a': inf}, which holds inf,"),
        (_Bounded, _Bounded(limit=1.0), "argument 'x', field 'limit': the default inf has no"),
    ],
)
def test_a_default_with_no_json_form_is_refused_naming_the_argument(
    annotation: Any, default: Any, said: str
) -> None:
    # It was accepted: the schema sent to the model held inf (the request could not be
    # encoded) and the stored snapshot null, so no interrupted run of the tool resumed.
    assert said in _default_refusal(annotation, default)


def _default_refusal(annotation: Any, default: Any) -> str:
    """What `tool` refuses a tool of one argument ``x: annotation = default`` with."""

    async def scaled(x: Any = default) -> str:
        return str(x)

    scaled.__annotations__["x"] = annotation
    with pytest.raises(UsageError) as refused:
        tool(scaled)
    return str(refused.value)


@attrs.frozen
class _Capped:
    limit: int = "ten"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("annotation", "default", "said"),
    [
        (int, "ten", "argument 'x': the default 'ten' does not fit the type: expected an integer"),
        (str, b"\x00\x01", "the default b'\\x00\\x01' does not fit the type: expected a string"),
        (str, None, "the default None does not fit the type: expected a string, got null"),
        (list[int], [1, "2"], "the default [1, '2'] does not fit the type: expected an integer"),
        (Color, "red", "the default 'red' does not fit the type: 'red' is of type str, not Color"),
        (int, 3.0, "the default 3.0 does not fit the type: 3.0 is of type float, not int"),
        (list[Color], ["red"], "the default ['red'] does not fit the type: 'red' is of type str"),
        (_Capped, _Capped(limit=3), "argument 'x', field 'limit': the default 'ten' does not fit"),
        pytest.param(
            int,
            10**5000,
            "argument 'x': the default holds an integer of about 5001 digits",
            id="huge-int",
        ),
        pytest.param(
            list[int],
            [10**5000],
            "argument 'x': the default holds an integer of about 5001",
            id="huge-int-in-a-list",
        ),
    ],
)
def test_a_default_that_is_no_value_of_its_type_is_refused_naming_the_argument(
    annotation: Any, default: Any, said: str
) -> None:
    """It was accepted: the schema showed the model a default of another type, and a call
    leaving the argument out gave the tool a value its validation refuses (bytes shown as
    base64 text); an integer too long to write failed with a raw ValueError."""

    assert said in _default_refusal(annotation, default)


@pytest.mark.parametrize(
    ("annotation", "default"),
    [
        (float, 1),
        (Color, Color.RED),
        (Level, Level.LOW),
        (Point, Point(x=1)),
        (list[Point], [Point(x=1)]),
        (dict[str, Color], {"a": Color.BLUE}),
        (Literal["C", "F"] | None, None),
    ],
)
def test_a_default_that_fits_its_type_as_json_is_accepted(annotation: Any, default: Any) -> None:
    async def scaled(x: Any = default) -> str:
        return str(x)

    scaled.__annotations__["x"] = annotation
    assert tool(scaled).signature.parameters[0].default is default


async def _agen(n: int) -> Any:
    yield n


def _gen(n: int) -> Any:
    yield n


@pytest.mark.parametrize("fn", [_agen, _gen])
def test_a_generator_function_is_refused_as_a_tool(fn: Callable[..., Any]) -> None:
    """An ``async def`` generator is no coroutine function: it ran as a plain def, and each
    call answered that an async_generator cannot be written as JSON."""
    with pytest.raises(UsageError, match="a generator function cannot be a tool"):
        tool(fn)


def _passing_on(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator's plain ``def`` wrapper that returns what ``fn`` returns."""

    @functools.wraps(fn)
    def passing_on(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return passing_on


def _awaited_passing_on(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator's ``async def`` wrapper that returns what ``fn`` returns."""

    @functools.wraps(fn)
    async def awaited_passing_on(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return awaited_passing_on


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (_passing_on(_agen), "an async generator"),
        (_passing_on(_gen), "a generator"),
        (_awaited_passing_on(_agen), "an async generator"),
    ],
    ids=["def_async_generator", "def_generator", "async_def_async_generator"],
)
async def test_a_generator_returned_by_a_decorated_tool_is_an_error_saying_so(
    fn: Callable[..., Any], kind: str
) -> None:
    """A decorated generator function's call is an error that names the generator.

    It passed the declaration's check, and each call answered that an async_generator (or a
    generator) cannot be written as JSON.
    """
    outcome = await Toolbox([tool(fn, name="pages")]).execute(action("pages", {"n": 2}))
    text = (
        f"Error: pages returned {kind}, not a result: a call returns one result (collect the "
        "items and return them as a list)"
    )
    assert outcome == ActionOutcome(status=ActionStatus.EXECUTED, observation=text, detail=text)


async def test_a_decorator_that_collects_a_generators_items_makes_a_tool() -> None:
    def collecting(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def collected(*args: Any, **kwargs: Any) -> list[Any]:
            return list(fn(*args, **kwargs))

        return collected

    def pages(n: int) -> Any:
        yield from range(n)

    outcome = await Toolbox([tool(collecting(pages))]).execute(action("pages", {"n": 3}))
    assert outcome == ActionOutcome(status=ActionStatus.EXECUTED, observation="[0,1,2]")


@pytest.mark.parametrize(
    "options",
    [
        {"name": "has space"},
        {"name": ""},
        {"name": "x" * 65},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"replay": "safe"},
        {"reconcile": lambda a: None},
        {"isolation": "thread"},
        {"isolation": "process"},  # a nested function cannot be imported in the child
    ],
)
def test_bad_options_raise_usage_error(options: dict[str, Any]) -> None:
    async def fine(city: str) -> str:
        return city

    with pytest.raises(UsageError):
        tool(**options)(fine)


def test_toolbox_refuses_duplicates_plain_functions_and_bad_timeouts() -> None:
    with pytest.raises(UsageError, match="two tools are named 'get_weather'"):
        Toolbox([get_weather, get_weather])
    with pytest.raises(UsageError, match="decorate it with @tool"):
        Toolbox([_sync])  # type: ignore[list-item]
    with pytest.raises(UsageError):
        Toolbox([get_weather], default_timeout_s=-1)


def test_environment_failure_is_a_treadle_error() -> None:
    assert issubclass(EnvironmentFailure, TreadleError)


# --------------------------------------------------------------------------- toolbox


calls: list[dict[str, Any]] = []


@tool(replay=ReplayPolicy.SAFE)
async def record(point: Point, color: Color = Color.RED, ctx: ToolContext | None = None) -> Point:
    """Record a point."""
    calls.append({"point": point, "color": color})
    return point


@tool
async def explode(message: str) -> str:
    raise ValueError(message)


@tool
async def lose_connection() -> str:
    raise EnvironmentFailure("sandbox is gone")


@tool
async def group_failure() -> str:
    raise ExceptionGroup("several", [EnvironmentFailure("db down"), ValueError("x")])


@tool(timeout_s=0.5)
async def slow() -> str:
    await trio.sleep_forever()
    return "never"


@tool(completes_task=True)
async def finish(summary: str) -> str:
    if summary == "fail":
        raise RuntimeError("not done")
    return "done"


@tool
async def who(ctx: ToolContext) -> ToolContext:
    return ctx


@tool
async def echo(value: dict[str, str] | list[int] | None = None) -> Any:
    return value


BOX = Toolbox(
    [get_weather, record, explode, lose_connection, group_failure, slow, finish, who, echo]
)


def test_toolbox_is_an_action_executor() -> None:
    assert isinstance(BOX, ActionExecutor)


def test_optional_context_is_injected_not_shown() -> None:
    assert record.signature.context_parameter == "ctx"
    assert "ctx" not in record.spec.parameters["properties"]


def test_specs_order_policies_and_lookups() -> None:
    assert [s.name for s in BOX.tool_specs()][:3] == ["get_weather", "record", "explode"]
    assert BOX.replay_policy("record") is ReplayPolicy.SAFE
    assert BOX.replay_policy("get_weather") is ReplayPolicy.NEVER
    assert BOX.replay_policy("nope") is ReplayPolicy.NEVER
    assert BOX.get("slow") is slow
    assert BOX.get("nope") is None
    assert BOX.timeout_s("slow") == 0.5
    assert BOX.timeout_s("echo") == 10.0
    assert not BOX.requires_approval("echo")


async def test_string_result_is_the_observation() -> None:
    outcome = await BOX.execute(action("get_weather", {"city": "Zürich", "days": 3}))
    assert outcome == ActionOutcome(status=ActionStatus.EXECUTED, observation="Zürich:3:C")


async def test_unknown_tool_is_not_executed_and_lists_known_tools() -> None:
    outcome = await BOX.execute(action("launch_rocket"))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.detail is not None
    assert "'launch_rocket'" in outcome.detail
    assert "get_weather, record" in outcome.detail
    assert outcome.observation == outcome.detail
    assert not outcome.task_completed


async def test_invalid_arguments_are_not_executed_with_every_error() -> None:
    calls.clear()
    outcome = await BOX.execute(
        action("record", {"point": {"x": "1", "q": 2}, "color": "green", "extra": 1})
    )
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert calls == []
    assert outcome.detail is not None
    assert "extra fields found (extra) @ $" in outcome.detail


@pytest.mark.parametrize(
    ("arguments", "errors"),
    [
        ({}, ["required field missing @ $.city"]),
        ({"city": 5}, ["expected a string, got integer @ $.city"]),
        ({"city": "a", "days": "3"}, ["expected an integer, got string @ $.days"]),
        ({"city": "a", "days": True}, ["expected an integer, got boolean @ $.days"]),
        ({"city": "a", "days": 1.5}, ["expected an integer, got number @ $.days"]),
        ({"city": "a", "unit": "K"}, ["expected one of 'C', 'F', got 'K' @ $.unit"]),
        (
            {"city": None, "days": None},
            ["expected a string, got null @ $.city", "expected an integer, got null @ $.days"],
        ),
        (["city"], ["expected a JSON object of arguments, got array"]),
    ],
)
async def test_validation_errors_are_precise(arguments: Any, errors: list[str]) -> None:
    outcome = await BOX.execute(action("get_weather", arguments))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.detail == "invalid arguments: " + "; ".join(errors)


@pytest.mark.parametrize(
    ("annotation", "value", "delivered"),
    [
        (Literal[1, 2], 1.0, 1),
        (Literal["a", 2], 2.0, 2),
        (Grade, 2.0, Grade.HIGH),
        (Literal[1, 2] | None, 2.0, 2),
    ],
)
def test_an_integral_number_is_an_int_literal_or_enum_value(
    annotation: Any, value: float, delivered: Any
) -> None:
    """JSON has one kind of number: ``1.0`` fits the schema's ``enum`` of 1 (an approval's
    edit was accepted so), and the tool's validation refused it."""
    found = _single_argument_tool(annotation).signature.validate({"x": value})
    assert found == {"x": delivered} and type(found["x"]) is type(delivered)


@pytest.mark.parametrize(
    ("annotation", "value"),
    [(Literal[1, 2], 1.5), (Literal[1, 2], True), (Literal[True], 1.0), (Grade, True)],
)
def test_a_fraction_or_a_boolean_is_no_int_literal_or_enum_value(
    annotation: Any, value: Any
) -> None:
    found = _single_argument_tool(annotation).signature.validate({"x": value})
    assert isinstance(found, Invalid) and found.errors[0].startswith("expected one of")


@pytest.mark.parametrize(
    ("annotation", "value", "delivered"),
    [
        (Level, 2, Level.HIGH),
        (Level, 1.0, Level.LOW),
        (Shade, "blue", Shade.BLUE),
        (Size, "l", Size.LARGE),
        (list[Level], [1, 2], [Level.LOW, Level.HIGH]),
        (Level | None, 2, Level.HIGH),
    ],
)
def test_an_int_or_str_enum_argument_is_given_its_member(
    annotation: Any, value: Any, delivered: Any
) -> None:
    """An enum that subclasses int or str is given as its member.

    An ``IntEnum``, a ``StrEnum`` or an enum mixing in ``str`` reached the ``int`` or ``str``
    hook before the enum's: the tool got a plain int or str (``level.name`` failed).
    """
    found = _single_argument_tool(annotation).signature.validate({"x": value})
    assert not isinstance(found, Invalid)
    got = found["x"] if isinstance(found["x"], list) else [found["x"]]
    wanted = delivered if isinstance(delivered, list) else [delivered]
    assert [(type(g), g) for g in got] == [(type(w), w) for w in wanted]


async def test_an_int_enum_tool_runs_with_its_member_never_with_another_int() -> None:
    seen: list[Level] = []

    @tool
    async def set_level(level: Level) -> str:
        """Set the level."""
        seen.append(level)
        return level.name

    box = Toolbox([set_level])
    refused = await box.execute(action("set_level", {"level": 5}))
    ran = await box.execute(action("set_level", {"level": 2}))
    assert refused.status is ActionStatus.NOT_EXECUTED
    assert refused.detail == "invalid arguments: expected one of 1, 2, got 5 @ $.level"
    assert (ran.status, ran.observation) == (ActionStatus.EXECUTED, "HIGH")
    assert [(type(level), level) for level in seen] == [(Level, Level.HIGH)]


@pytest.mark.parametrize(
    ("annotation", "value", "error"),
    [
        (Level, 5, "expected one of 1, 2, got 5 @ $.x"),
        (Level, True, "expected one of 1, 2, got True @ $.x"),
        (Level, "1", "expected one of 1, 2, got '1' @ $.x"),
        (Shade, "purple", "expected one of 'red', 'blue', got 'purple' @ $.x"),
        (Size, 1, "expected one of 's', 'l', got 1 @ $.x"),
        (list[Level], [7], "expected one of 1, 2, got 7 @ $.x[0]"),
    ],
)
def test_a_value_of_no_member_is_refused_for_an_int_or_str_enum(
    annotation: Any, value: Any, error: str
) -> None:
    """Only a member's value is taken for an enum that subclasses int or str.

    The schema's ``enum`` lists the members' values; the tool's validation took any integer or
    string for these enums, and the tool ran with it.
    """
    found = _single_argument_tool(annotation).signature.validate({"x": value})
    assert isinstance(found, Invalid) and found.errors == (error,)


@pytest.mark.parametrize(
    "annotation",
    [
        *(Level, Shade, Size, Grade, Color, list[Level], Level | None, Literal[1, 2]),
        *(float, list[float], float | None, int),
    ],
)
def test_the_schema_check_and_the_tools_validation_accept_the_same_values(
    annotation: Any,
) -> None:
    """The schema check and the tool's validation take the same values.

    An approval's edit is checked against the schema (docs/events.md, "Human approval"), the
    model's arguments by the tool's validation: each accepts what the other does.
    """
    schema_tool = _single_argument_tool(annotation)
    check = argument_validator(schema_tool.signature.schema)
    for value in _ARGUMENT_VALUES:
        by_schema = check.is_valid({"x": value})
        by_tool = not isinstance(schema_tool.signature.validate({"x": value}), Invalid)
        assert by_schema == by_tool, (value, by_schema, by_tool)


_ARGUMENT_VALUES: list[Any] = [
    *(0, 1, 2, 5, -1, 1.0, 2.0, 1.5, 10**20, 10**400, -(10**400), 1e308, True, False),
    *(None, "1", "red", "blue", "s", "l", "purple", [], [1], [7], [10**400], {}, {"a": 1}),
]
"""Values the schema check and the tool's validation are compared on."""


Branch = attrs.make_class(  # written as a module without ``from __future__ import annotations``
    "Branch",
    {"name": attrs.field(type=str), "kids": attrs.field(type=list["Branch"], factory=list)},
    frozen=True,
)


def test_an_attrs_argument_naming_its_own_class_in_quotes_inside_a_type_is_validated() -> None:
    # kids: list["Branch"] held the name, which the strict converter had no hook for: every
    # call raised StructureHandlerNotFoundError instead of being validated.
    found = _single_argument_tool(Branch).signature.validate({"x": {"name": "a", "kids": [{}]}})
    assert isinstance(found, Invalid)
    assert found.errors == ("required field missing @ $.x.kids[0].name",)
    found = _single_argument_tool(Branch).signature.validate(
        {"x": {"name": "a", "kids": [{"name": "b"}]}}
    )
    assert found == {"x": Branch(name="a", kids=[Branch(name="b")])}


def _single_argument_tool(annotation: Any) -> Tool:
    """A tool of one argument ``x`` of type ``annotation``."""

    async def takes_x(x: Any) -> str:
        return repr(x)

    takes_x.__annotations__ = {"x": annotation, "return": str}
    return tool(name="takes_x")(takes_x)


async def test_nested_and_union_validation() -> None:
    bad = await BOX.execute(action("record", {"point": {"x": 1, "z": 0}}))
    assert bad.detail == "invalid arguments: extra fields found (z) @ $.point"
    bad = await BOX.execute(action("record", {"point": [1, 2]}))
    assert bad.detail == "invalid arguments: expected an object, got array @ $.point"
    bad = await BOX.execute(action("echo", {"value": "abc"}))
    assert (
        bad.detail
        == "invalid arguments: expected an object or an array or null, got string @ $.value"
    )
    good = await BOX.execute(action("echo", {"value": [1, 2]}))
    assert good.observation == "[1,2]"


@pytest.mark.parametrize(
    ("annotation", "value", "said"),
    [
        (Literal["a", "b"] | None, "c", "expected one of 'a', 'b' or null, got string 'c'"),
        (Level | None, 7, "expected one of 1, 2 or null, got integer 7"),
        (Literal["a", "b"] | None, [1], "expected one of 'a', 'b' or null, got array"),
        (int | None, "c", "expected an integer or null, got string"),
    ],
)
def test_a_union_of_values_says_them_and_the_value_given(
    annotation: Any, value: Any, said: str
) -> None:
    # Literal["a", "b"] | None refusing "c" said "expected one of the allowed values or null,
    # got string": neither what to give nor what was given.
    found = _single_argument_tool(annotation).signature.validate({"x": value})
    assert found == Invalid(errors=(f"{said} @ $.x",))


def _positive(_: Any, __: Any, value: int) -> None:
    if value <= 0:
        raise ValueError("must be positive")


@attrs.define
class _Order:
    sku: str = attrs.field(validator=attrs.validators.in_(["A1", "B2"]))
    quantity: int = attrs.field(validator=attrs.validators.gt(0))
    boxes: int = attrs.field(default=1, validator=_positive)


@tool
async def place(order: _Order, gift: _Order | None = None) -> str:
    """Place an order."""
    return "placed"


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (
            {"order": {"sku": "A1", "quantity": 0}},
            "invalid value: 'quantity' must be > 0: 0 @ $.order",
        ),
        (
            {"order": {"sku": "Z9", "quantity": 1}},
            "invalid value: 'sku' must be in ['A1', 'B2'] (got 'Z9') @ $.order.sku",
        ),
        (
            {"order": {"sku": "A1", "quantity": 1, "boxes": 0}},
            "invalid value: must be positive @ $.order",
        ),
        (  # was "expected an object or null, got object"
            {"order": {"sku": "A1", "quantity": 1}, "gift": {"sku": "B2", "quantity": -1}},
            "invalid value: 'quantity' must be > 0: -1 @ $.gift",
        ),
        (
            {"order": {"sku": "A1", "quantity": 1}, "gift": {"sku": "B2", "quantity": "2"}},
            "expected an integer, got string @ $.gift.quantity",
        ),
        (
            {"order": {"sku": "A1", "quantity": 1}, "gift": 3},
            "expected an object or null, got integer @ $.gift",
        ),
    ],
)
async def test_a_validators_refusal_says_why(arguments: dict[str, Any], said: str) -> None:
    # An attrs validator's refusal read "invalid value @ $.order": no field and no reason.
    box = Toolbox([place])
    assert box.invalid_arguments("place", arguments) == f"invalid arguments: {said}"
    outcome = await box.execute(action("place", arguments))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.detail == f"invalid arguments: {said}"


@attrs.define
class _Card:
    number: str = attrs.field(validator=attrs.validators.matches_re(r"[0-9]{16}"))


@tool(secret_arguments=("card",))
async def pay(card: _Card) -> str:
    """Pay by card."""
    return "paid"


async def test_a_validators_refusal_of_a_secret_argument_never_quotes_its_value() -> None:
    # The refusal's text quotes the value; it leaves the executor redacted, as any detail.
    card = "4111-2222-3333-4444"
    model = ScriptedModel(turns=[call("pay", card={"number": card}), say("done")])
    agent = treadle.Agent(
        model=model, executor=Toolbox([pay]), parser=treadle.NativeToolCallParser()
    )
    store = treadle.MemoryStore()
    await treadle.run(agent, "pay", store=store, run_id="r")
    (result,) = [r for r in (await store.read_log("r")).records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.NOT_EXECUTED
    assert result.outcome.detail == (
        "invalid arguments: invalid value: 'number' must match regex '[0-9]{16}' "
        "('[redacted]' doesn't) @ $.card.number"
    )
    assert card not in result.outcome.observation


async def test_integral_float_is_an_integer() -> None:
    outcome = await BOX.execute(action("get_weather", {"city": "a", "days": 2.0}))
    assert outcome.observation == "a:2:C"


async def test_structured_arguments_reach_the_tool_and_results_become_json() -> None:
    calls.clear()
    outcome = await BOX.execute(action("record", {"point": {"x": 4}, "color": "blue"}))
    assert calls == [{"point": Point(x=4, y=0), "color": Color.BLUE}]
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation == '{"x":4,"y":0}'


@pytest.mark.parametrize(
    ("value", "observation"),
    [
        (None, "null"),
        ({"city": "Zürich"}, '{"city":"Zürich"}'),
    ],
)
async def test_other_results_are_compact_json(value: Any, observation: str) -> None:
    outcome = await BOX.execute(action("echo", {} if value is None else {"value": value}))
    assert outcome.observation == observation


async def test_result_that_is_not_json_is_reported() -> None:
    @tool
    async def weird() -> object:
        return object()

    outcome = await Toolbox([weird]).execute(action("weird"))
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation.startswith("Error: the result of weird could not be written as JSON")


@tool
async def blob() -> bytes:
    """Return bytes."""
    return b"\x00\x01hello"


@tool
async def ratios() -> dict[str, float]:
    """Return a ratio that is undefined."""
    return {"ratio": float("nan"), "max": float("inf")}


@tool
def returns_a_coroutine() -> str:
    """A plain def that returns a coroutine by mistake."""
    return blob.fn()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("found", "observation"),
    [
        (
            blob,
            "Error: the result of blob could not be written as JSON: it holds bytes, which "
            "JSON has no form for (decode it to text, or encode it yourself, e.g. base64)",
        ),
        (ratios, '{"ratio":null,"max":null}'),
        (
            returns_a_coroutine,
            "Error: TypeError: returns_a_coroutine is a plain def that returned an awaitable; "
            "declare it async def to have it awaited",
        ),
    ],
)
async def test_results_json_has_no_form_for_are_refused_or_written_as_json(
    found: Tool, observation: str
) -> None:
    """Bytes became base85 text, NaN the non-JSON ``NaN`` (now ``null``, as
    ``JSON.stringify`` writes it), and a coroutine returned by a plain def an error naming
    an internal function."""
    outcome = await Toolbox([found]).execute(action(found.name))
    assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, observation)


@pytest.mark.parametrize(
    ("key", "kind"),
    [((0, 0), "tuple"), (frozenset({1}), "frozenset"), (Point(x=1), "Point"), (object(), "object")],
    ids=["tuple", "frozenset", "attrs", "object"],
)
async def test_a_result_key_json_cannot_write_is_named_in_the_observation(
    key: object, kind: str
) -> None:
    """A tuple key was unstructured to a list, and building the dict failed with "unhashable
    type: 'list'", a type the result does not hold: the observation names the key's own."""

    @tool
    async def grid() -> dict[object, str]:
        """Cells by coordinate."""
        return {"origin": "here", key: "start"}

    outcome = await Toolbox([grid]).execute(action("grid"))
    assert (outcome.status, outcome.observation) == (
        ActionStatus.EXECUTED,
        f"Error: the result of grid could not be written as JSON: it has a key of type {kind}, "
        "and a JSON object's keys are str, int, float, bool or None",
    )


async def test_keys_json_writes_as_text_stay_keys() -> None:
    """Enum, date and number keys are unstructured like values and written as text."""

    @tool
    async def keyed() -> dict[object, int]:
        """Keys of several kinds."""
        return {Color.BLUE: 1, datetime.date(2024, 5, 1): 2, 3: 3, 1.5: 4, None: 5}

    outcome = await Toolbox([keyed]).execute(action("keyed"))
    assert json.loads(outcome.observation) == {
        Color.BLUE.value: 1,
        "2024-05-01": 2,
        "3": 3,
        "1.5": 4,
        "null": 5,
    }


async def test_an_integer_too_large_for_a_float_is_a_precise_validation_error() -> None:
    """It was "unknown error (int too large to convert to float)"; a union with int takes it."""

    @tool
    async def scale(x: float, y: float | int = 0) -> str:
        """Scale."""
        return f"{y}"

    box = Toolbox([scale])
    refused = await box.execute(action("scale", {"x": 10**400}))
    assert refused.detail == (
        "invalid arguments: expected a number, got an integer too large for one @ $.x"
    )
    taken = await box.execute(action("scale", {"x": 1, "y": 10**400}))
    assert taken.observation == str(10**400)


async def test_tool_that_raises_is_executed_with_the_error() -> None:
    outcome = await BOX.execute(action("explode", {"message": "boom"}))
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED, observation="Error: ValueError: boom"
    )


async def test_environment_failure_is_env_error() -> None:
    outcome = await BOX.execute(action("lose_connection"))
    assert outcome.status is ActionStatus.ENV_ERROR
    assert outcome.detail == "Error: EnvironmentFailure: sandbox is gone"
    outcome = await BOX.execute(action("group_failure"))
    assert outcome.status is ActionStatus.ENV_ERROR
    assert outcome.detail == "Error: EnvironmentFailure: db down"


async def test_timeout_is_executed_with_a_timeout_observation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    outcome = await BOX.execute(action("slow"))
    assert trio.current_time() - start == pytest.approx(0.5)
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED, observation="Error: the call to slow timed out after 0.5 s"
    )


async def test_default_timeout_applies(autojump_clock: trio.testing.MockClock) -> None:
    @tool
    async def hang() -> str:
        await trio.sleep_forever()
        return ""

    start = trio.current_time()
    outcome = await Toolbox([hang], default_timeout_s=3).execute(action("hang"))
    assert trio.current_time() - start == pytest.approx(3)
    assert outcome.observation == "Error: the call to hang timed out after 3 s"


def _failing_as_cancelled(
    timeout_s: float, closing: list[str], *, waits_in_block: bool = True
) -> Tool:
    """A tool waiting in a nursery whose other task's cleanup raises when it is cancelled.

    With ``waits_in_block`` false the tool waits in the nursery's exit, where trio puts no
    cancellation into the group the nursery raises: the group holds the error alone.
    """

    @tool(name="cleanup", timeout_s=timeout_s)
    async def cleanup() -> str:
        """Fetch pages concurrently."""

        async def worker() -> None:
            try:
                await trio.sleep_forever()
            finally:
                closing.append("closing")
                raise ValueError("connection pool closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
            if waits_in_block:
                await trio.sleep_forever()
        return "never"

    return cleanup


async def test_an_error_raised_beside_the_timeouts_cancellation_is_the_calls_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The nursery's group held the cancellation and the error: execute raised the error."""
    closing: list[str] = []
    outcome = await Toolbox([_failing_as_cancelled(2, closing)]).execute(action("cleanup"))
    assert closing == ["closing"]
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation=(
            "Error: the call to cleanup timed out after 2 s, and raised ValueError: connection "
            "pool closed as it was cancelled"
        ),
    )


async def test_an_error_raised_at_the_timeout_without_a_cancellation_is_the_calls_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The nursery's group held the error alone: the timeout having fired still says so."""
    closing: list[str] = []
    cleanup = _failing_as_cancelled(2, closing, waits_in_block=False)
    outcome = await Toolbox([cleanup]).execute(action("cleanup"))
    assert closing == ["closing"]
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation=(
            "Error: the call to cleanup timed out after 2 s, and raised ValueError: connection "
            "pool closed as it was cancelled"
        ),
    )


async def test_an_error_raised_without_a_cancellation_before_the_timeout_is_an_error() -> None:
    @tool(timeout_s=60)
    async def fail_in_group() -> str:
        async def worker() -> None:
            raise ValueError("connection pool closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker)
        return "never"

    outcome = await Toolbox([fail_in_group]).execute(action("fail_in_group"))
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation.startswith("Error: ExceptionGroup: ")
    assert "timed out" not in outcome.observation


async def test_an_error_raised_beside_an_outer_cancellation_leaves_the_cancellation_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closing: list[str] = []
    with trio.move_on_after(1) as scope:
        await Toolbox([_failing_as_cancelled(60, closing)]).execute(action("cleanup"))
        pytest.fail("execute returned after being cancelled")
    assert closing == ["closing"] and scope.cancelled_caught


async def test_outer_cancellation_propagates(autojump_clock: trio.testing.MockClock) -> None:
    with trio.move_on_after(0.1) as scope:
        await BOX.execute(action("slow"))
        pytest.fail("execute returned after being cancelled")
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(0.1)


async def test_execute_yields_only_where_its_tool_does_and_a_cancelled_call_never_starts() -> None:
    task = trio.lowlevel.current_task()
    schedule_points = task._schedule_points
    await BOX.execute(action("get_weather", {"city": "Oslo"}))  # a tool that never awaits
    assert task._schedule_points == schedule_points
    with trio.CancelScope() as scope:
        scope.cancel()
        await BOX.execute(action("explode", {"message": "must not run"}))
    assert scope.cancelled_caught


async def test_completion_tool_signals_only_when_it_returns() -> None:
    done = await BOX.execute(action("finish", {"summary": "ok"}))
    assert done.task_completed
    failed = await BOX.execute(action("finish", {"summary": "fail"}))
    assert not failed.task_completed
    assert failed.observation == "Error: RuntimeError: not done"
    assert not (await BOX.execute(action("echo"))).task_completed


async def test_context_is_injected() -> None:
    outcome = await BOX.execute(action("who", generation=4), replay=True)
    assert json.loads(outcome.observation) == {
        "run_id": "run-1",
        "step": 3,
        "intent_id": "run-1/s3/a1",
        "call_id": "call_1",
        "tool": "who",
        "replay": True,
        "resource": None,
        "seen_revision": None,
        "tokens_left": None,
        "deadline": None,  # inf: JSON has no form for it
        "forward_event": None,
        "run_cancelled": None,
        "report_active_s": None,
        "can_park": False,
        "generation": 4,  # the call's fencing token: docs/crash-safety.md, "A paused driver"
    }


async def test_reconcile_hook(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[str] = []

    async def look_up(a: Action) -> ActionOutcome | None:
        seen.append(a.intent_id)
        if a.arguments.get("hang"):
            await trio.sleep_forever()
        return ActionOutcome(status=ActionStatus.EXECUTED, observation="it was booked")

    @tool(reconcile=look_up, timeout_s=1)
    async def book(hang: bool = False) -> str:
        return "booked"

    box = Toolbox([book, get_weather])
    outcome = await box.reconcile(action("book"))
    assert outcome is not None
    assert outcome.observation == "it was booked"
    assert seen == ["run-1/s3/a1"]
    assert await box.reconcile(action("book", {"hang": True})) is None
    assert await box.reconcile(action("get_weather")) is None
    assert await box.reconcile(action("nope")) is None


# --------------------------------------------------------------------------- properties

Strategy = st.SearchStrategy[Any]

POINTS = st.builds(lambda x, y: {"x": x, "y": y}, st.integers(), st.integers())
TYPE_POOL: list[tuple[Any, Strategy]] = [
    (str, st.text()),
    (int, st.integers()),
    (float, st.floats(allow_nan=False, allow_infinity=False)),
    (bool, st.booleans()),
    (int | None, st.none() | st.integers()),
    (list[str], st.lists(st.text(), max_size=3)),
    (dict[str, int], st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
    (Literal["a", "b", 3], st.sampled_from(["a", "b", 3])),
    (Color, st.sampled_from(["red", "blue"])),
    (Level, st.sampled_from([1, 2])),
    (Point, POINTS),
    (list[Point], st.lists(POINTS, max_size=2)),
    (str | list[int], st.text() | st.lists(st.integers(), max_size=3)),
]
names = st.from_regex(r"\A[a-z][a-z0-9_]{0,8}\Z").filter(lambda n: not keyword.iskeyword(n))


@st.composite
def signatures(draw: st.DrawFn) -> list[tuple[str, int, bool]]:
    """(argument name, index into TYPE_POOL, required) for a random tool signature."""
    arg_names = draw(st.lists(names, max_size=6, unique=True))
    return [
        (name, draw(st.integers(0, len(TYPE_POOL) - 1)), draw(st.booleans())) for name in arg_names
    ]


def build_tool(signature: list[tuple[str, int, bool]]) -> Tool:
    async def returns_arguments(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    params = []
    for name, index, required in signature:
        annotation = TYPE_POOL[index][0]
        if not required:
            annotation = annotation | None
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=annotation,
                default=inspect.Parameter.empty if required else None,
            )
        )
    returns_arguments.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    returns_arguments.__annotations__ = {p.name: p.annotation for p in params}
    return tool(name="generated")(returns_arguments)


@st.composite
def tools_with_arguments(draw: st.DrawFn) -> tuple[Tool, dict[str, Any], list[str]]:
    signature = draw(signatures())
    arguments: dict[str, Any] = {}
    for name, index, required in signature:
        if required or draw(st.booleans()):
            arguments[name] = draw(TYPE_POOL[index][1])
    required_names = [name for name, _, required in signature if required]
    return build_tool(signature), arguments, required_names


def expected_echo(tool_: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    """What the tool receives, written back as JSON: left-out arguments are None."""
    out: dict[str, Any] = {p.name: None for p in tool_.signature.parameters}
    out.update(arguments)
    echoed: dict[str, Any] = json.loads(json.dumps(out))
    return echoed


@settings(max_examples=150, deadline=None)
@given(case=tools_with_arguments())
async def test_generated_schemas_accept_and_deliver_valid_arguments(
    case: tuple[Tool, dict[str, Any], list[str]],
) -> None:
    tool_, arguments, required = case
    schema = tool_.spec.parameters
    assert schema.get("required", []) == required
    assert set(schema["properties"]) == {p.name for p in tool_.signature.parameters}
    assert schema["additionalProperties"] is False
    outcome = await Toolbox([tool_]).execute(action("generated", arguments))
    assert outcome.status is ActionStatus.EXECUTED, outcome.detail
    assert json.loads(outcome.observation) == expected_echo(tool_, arguments)


@settings(max_examples=100, deadline=None)
@given(case=tools_with_arguments(), extra=names)
async def test_generated_schemas_refuse_extra_and_missing_arguments(
    case: tuple[Tool, dict[str, Any], list[str]], extra: str
) -> None:
    tool_, arguments, required = case
    box = Toolbox([tool_])
    if extra not in arguments and extra not in {p.name for p in tool_.signature.parameters}:
        outcome = await box.execute(action("generated", {**arguments, extra: 1}))
        assert outcome.status is ActionStatus.NOT_EXECUTED
        assert f"extra fields found ({extra})" in (outcome.detail or "")
    if required:
        missing = {k: v for k, v in arguments.items() if k != required[0]}
        outcome = await box.execute(action("generated", missing))
        assert outcome.status is ActionStatus.NOT_EXECUTED
        assert f"required field missing @ $.{required[0]}" in (outcome.detail or "")


def test_the_tool_policies_protocol_names_every_optional_executor_method():
    """The library asks executors only what `ToolPolicies` declares (the seam says all it
    carries), in one place (`policies_of`), and `Toolbox` answers all of it."""
    import inspect
    import re
    from pathlib import Path

    import treadle
    from treadle.policies import POLICY_METHODS, ExecutorPolicies, policies_of
    from treadle.ports import ToolPolicies

    declared = {
        name
        for name, value in vars(ToolPolicies).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    assert set(POLICY_METHODS) == declared
    assert {f.name for f in attrs.fields(ExecutorPolicies)} == {"declared", *declared}
    source = Path(treadle.__file__).parent
    asked_by_name = [
        (path.name, name)
        for path in source.rglob("*.py")
        for name in re.findall(r'getattr\((?:self\.)?\w*executor\w*, "(\w+)"', path.read_text())
    ]
    assert asked_by_name == []  # nothing looks an executor's methods up by name any more
    assert isinstance(Toolbox([]), ToolPolicies)
    assert policies_of(Toolbox([])).declared == declared


def _tool_made_per_run(default: object) -> Tool:
    """A tool defined inside a function, as a toolbox built per run makes one."""

    @tool(name="pick")
    def pick(count: int | bool = default) -> str:  # type: ignore[assignment]
        """Pick.

        Args:
            count: how many.
        """
        return str(count)

    return pick


def test_a_tool_made_again_per_run_shares_its_argument_model_but_never_another_default() -> None:
    first, again = _tool_made_per_run(3), _tool_made_per_run(3)
    assert again.signature.model is first.signature.model  # built once, not per run
    assert again.signature.schema == first.signature.schema
    assert again.signature.schema is not first.signature.schema  # each tool owns its schema
    # equal under ``==`` and ``hash`` (True == 1, 0.0 == -0.0), different in the schema
    assert _tool_made_per_run(1).signature.schema["properties"]["count"]["default"] == 1
    flag = _tool_made_per_run(True).signature.schema["properties"]["count"]["default"]
    assert flag is True
    assert _tool_made_per_run(1).signature.model is not _tool_made_per_run(True).signature.model
    filled = _tool_made_per_run(True).signature.validate({})
    assert filled == {"count": True} and filled["count"] is True


def test_tools_defined_again_never_share_a_default_object_or_a_union_order() -> None:
    """A tool defined per run got the first definition's default (a list mutated by one run
    reached the next; an attrs default equal in ``repr`` but not in value) or its union order
    (``int | float == float | int``, yet the schema and the values given follow the order)."""

    @attrs.frozen
    class Opts:
        depth: int = attrs.field(default=0, repr=False)

    def defined(default: object, annotation: object) -> Tool:
        def note(text: str, tags=default, x=1) -> str:  # type: ignore[no-untyped-def]
            return text

        kind = list[str] if isinstance(default, list) else type(default)
        note.__annotations__ = {"text": str, "tags": kind, "x": annotation, "return": str}
        return tool(note)

    first, second = defined([], int | float), defined([], int | float)
    tags = first.signature.validate({"text": "a"})["tags"]
    assert tags is not second.signature.validate({"text": "a"})["tags"]
    shallow, deep = defined(Opts(depth=1), int), defined(Opts(depth=5), int)
    assert deep.signature.schema["properties"]["tags"]["default"] == {"depth": 5}
    assert deep.signature.validate({"text": "a"})["tags"].depth == 5
    assert shallow.signature.validate({"text": "a"})["tags"].depth == 1
    swapped = defined([], float | int)
    assert [t["type"] for t in swapped.signature.schema["properties"]["x"]["anyOf"]] == [
        "number",
        "integer",
    ]
    assert type(swapped.signature.validate({"text": "a", "x": 1.0})["x"]) is float
