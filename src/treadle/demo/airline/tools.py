"""The 14 airline tools over an `AirlineDatabase`, with their specs and a dispatcher.

Every tool takes decoded JSON arguments and returns the text the model sees. Read tools
return the stored JSON record (``json.dumps`` of the document); refusals are texts starting
with ``Error:`` (a refusal is a normal result, not an exception). Six tools change the
database; each runs its change in one SQLite transaction together with the insert of its
idempotency key into ``applied_actions``, so calling it again with a key already applied
returns the stored output and changes nothing.

"Now" is 2024-05-15 15:00:00 EST (`NOW`). New reservation ids are the first unused of
``HATHAT``, ``HATHAU``, ``HATHAV`` (a fourth booking replaces ``HATHAV``); a user's new
certificate id is the first unused of ``certificate_3221322`` to ``certificate_3221324`` in
that user's payment methods.

The tools reproduce the recorded environment (tau-bench's airline domain) exactly, its quirks
included; docs/demo.md, "The environment's quirks", lists them.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import attrs

from treadle._exceptions import TreadleError
from treadle.demo.airline.db import AirlineDatabase, Documents
from treadle.types import JSONValue, ToolSpec

NOW: Final = "2024-05-15T15:00:00"
"""The environment's current time (EST), stamped on new reservations as ``created_at``."""

AIRPORTS: Final[Mapping[str, str]] = {
    "SFO": "San Francisco",
    "JFK": "New York",
    "LAX": "Los Angeles",
    "ORD": "Chicago",
    "DFW": "Dallas",
    "DEN": "Denver",
    "SEA": "Seattle",
    "ATL": "Atlanta",
    "MIA": "Miami",
    "BOS": "Boston",
    "PHX": "Phoenix",
    "IAH": "Houston",
    "LAS": "Las Vegas",
    "MCO": "Orlando",
    "EWR": "Newark",
    "CLT": "Charlotte",
    "MSP": "Minneapolis",
    "DTW": "Detroit",
    "PHL": "Philadelphia",
    "LGA": "LaGuardia",
}
"""IATA code -> city, in the order `list_all_airports` reports them."""

INSURANCE_PRICE: Final = 30
"""Travel insurance, dollars per passenger."""

BAG_PRICE: Final = 50
"""Each non-free checked bag, dollars."""

FIRST_RESERVATION_ID: Final = "HATHAT"
"""The first new reservation id; later ones count up in letters (``HATHAU``, ``HATHAV``)."""

RESERVATION_IDS: Final = 3
"""How many reservation ids `book_reservation` uses (``HATHAT`` to ``HATHAV``)."""

FIRST_CERTIFICATE_NUMBER: Final = 3221322
"""The number in a user's first new certificate id, ``certificate_3221322``."""

CERTIFICATE_IDS: Final = 3
"""How many certificate ids `send_certificate` tries (``...322`` to ``...324``)."""


class AirlineToolError(TreadleError):
    """A tool call the airline environment cannot run (nothing was changed)."""


class UnknownToolError(AirlineToolError, LookupError):
    """The tool name is not one of the 14 airline tools.

    Attributes:
        tool: the name as given.
    """

    def __init__(self, tool: str) -> None:
        super().__init__(f"unknown airline tool {tool!r}")
        self.tool = tool


class InvalidArgumentsError(AirlineToolError, ValueError):
    """The arguments do not match the tool's parameter schema.

    Attributes:
        tool: the tool name.
        problem: what is wrong, e.g. ``flights[0].date: missing``.
    """

    def __init__(self, tool: str, problem: str) -> None:
        super().__init__(f"invalid arguments for {tool}: {problem}")
        self.tool = tool
        self.problem = problem


class IntentConflictError(AirlineToolError):
    """An idempotency key already applied by a different tool was given again.

    Attributes:
        intent_id: the key.
        applied_tool: the tool that applied it.
        tool: the tool now called with it.
    """

    def __init__(self, intent_id: str, *, applied_tool: str, tool: str) -> None:
        super().__init__(
            f"intent {intent_id!r} was applied by {applied_tool}, not {tool}; "
            "an idempotency key belongs to one action"
        )
        self.intent_id = intent_id
        self.applied_tool = applied_tool
        self.tool = tool


Doc = dict[str, Any]

# --------------------------------------------------------------------------- read tools


def get_user_details(docs: Documents, args: Mapping[str, Any]) -> str:
    """Return the user's profile as JSON."""
    user = docs.get("users", args["user_id"])
    return "Error: user not found" if user is None else json.dumps(user)


def get_reservation_details(docs: Documents, args: Mapping[str, Any]) -> str:
    """Return the reservation as JSON; ``Error: user not found`` when there is none."""
    reservation = docs.get("reservations", args["reservation_id"])
    # The recorded environment says "user", not "reservation", here.
    return "Error: user not found" if reservation is None else json.dumps(reservation)


def list_all_airports(docs: Documents, args: Mapping[str, Any]) -> str:
    """Return the airports served, IATA code -> city, as JSON."""
    return json.dumps(dict(AIRPORTS))


def _offer(flight: Doc, date: str) -> Doc | None:
    """The flight as searchable on ``date`` (without its dates), or None when not bookable."""
    day = flight["dates"].get(date)
    if day is None or day.get("status") != "available":
        return None
    return {**{k: v for k, v in flight.items() if k != "dates"}, **day}


def search_direct_flight(docs: Documents, args: Mapping[str, Any]) -> str:
    """Return the bookable direct flights between two airports on a date, as a JSON list."""
    found = []
    for _, flight in docs.all("flights"):
        if flight["origin"] == args["origin"] and flight["destination"] == args["destination"]:
            offer = _offer(flight, args["date"])
            if offer is not None:
                found.append(offer)
    return json.dumps(found)


def _next_day_label(date: str) -> str:
    """The recorded environment's "next day" of ``date``: ``2024-05-`` + (last two digits + 1).

    It ignores the month and does not pad: ``2024-05-05`` gives ``2024-05-6`` (a date no flight
    has), ``2024-05-30`` gives ``2024-05-31``.

    Raises:
        ValueError: the last two characters of ``date`` are not a number (as ``int()`` does).
    """
    return f"2024-05-{int(date[-2:]) + 1}"


def _leg_on(flight: Doc, day: Doc, date: str) -> Doc:
    return {**{k: v for k, v in flight.items() if k != "dates"}, **day, "date": date}


def _available_on(flight: Doc, date: str) -> bool:
    day = flight["dates"].get(date)
    return day is not None and day.get("status") == "available"


def search_onestop_flight(docs: Documents, args: Mapping[str, Any]) -> str:
    """Return bookable one-stop connections as a JSON list of ``[first, second]`` legs.

    Reproduces the recorded environment (docs/demo.md, "The environment's quirks"): the
    second leg leaves on the search date, or on `_next_day_label` of it when the first leg
    arrives after midnight (``+1``), and not before the first leg's scheduled arrival time
    (compared as ``HH:MM:SS`` text). Both legs must be available on their own dates, but the
    second leg's status, seats and prices shown are those of the search date (its ``date``
    field is its own). A second leg without an entry for the search date makes the whole
    search fail with ``Error: '<date>'``; a date whose last two characters are not a number
    fails with the ``int()`` error text when an overnight first leg is considered.
    """
    date = args["date"]
    flights = [flight for _, flight in docs.all("flights")]
    found = []
    for first in flights:
        if first["origin"] != args["origin"]:
            continue
        arrival = first["scheduled_arrival_time_est"]
        for second in flights:
            if second["destination"] != args["destination"]:
                continue
            if first["destination"] != second["origin"]:
                continue
            try:
                second_date = _next_day_label(date) if "+1" in arrival else date
            except ValueError as exc:
                return f"Error: {exc}"
            if arrival > second["scheduled_departure_time_est"]:
                continue
            if not (_available_on(first, date) and _available_on(second, second_date)):
                continue
            if date not in second["dates"]:
                return f"Error: {date!r}"
            found.append(
                [
                    _leg_on(first, first["dates"][date], date),
                    _leg_on(second, second["dates"][date], second_date),
                ]
            )
    return json.dumps(found)


_OPERATORS: Final[Mapping[type[ast.AST], Callable[..., Any]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_EXPRESSION_CHARACTERS: Final = frozenset("0123456789+-*/(). ")
_MAX_EXPONENT: Final = 1000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return cast(int | float, node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError("unsupported expression")


def calculate(docs: Documents, args: Mapping[str, Any]) -> str:
    """Evaluate an arithmetic expression; the result is rounded to 2 decimals, as float text."""
    expression: str = args["expression"]
    if not set(expression) <= _EXPRESSION_CHARACTERS:
        return "Error: invalid characters in expression"
    try:
        tree = ast.parse(expression.lstrip(" "), filename="<string>", mode="eval")
        value = float(_evaluate(tree))
    except (SyntaxError, ValueError, ArithmeticError) as exc:
        return f"Error: {exc}"
    if not math.isfinite(value):
        return "Error: result is not a finite number"
    return str(round(value, 2))


def think(docs: Documents, args: Mapping[str, Any]) -> str:
    """Record a thought; returns the empty string."""
    return ""


def transfer_to_human_agents(docs: Documents, args: Mapping[str, Any]) -> str:
    """Hand the customer over to a human agent (this ends the conversation)."""
    return "Transfer successful"


# --------------------------------------------------------------------------- write tools


def _priced_leg(docs: Documents, wanted: Mapping[str, Any], cabin: str, seats: int) -> Doc | str:
    """The requested leg with its current price, origin and destination, or an error text."""
    number, date = wanted["flight_number"], wanted["date"]
    flight = docs.get("flights", number)
    if flight is None:
        return f"Error: flight {number} not found"
    day = flight["dates"].get(date)
    if day is None:
        return f"Error: flight {number} not found on date {date}"
    if day.get("status") != "available":
        return f"Error: flight {number} not available on date {date}"
    if day["available_seats"][cabin] < seats:
        return f"Error: not enough seats on flight {number}"
    return {
        **wanted,
        "price": day["prices"][cabin],
        "origin": flight["origin"],
        "destination": flight["destination"],
    }


def _successor(key: str) -> str:
    """The next id in base-26 letter counting (``HATHAT`` -> ``HATHAU``)."""
    letters = list(key)
    i = len(letters) - 1
    while letters[i] == "Z":
        letters[i] = "A"
        i -= 1
    letters[i] = chr(ord(letters[i]) + 1)
    return "".join(letters)


def _new_reservation_id(docs: Documents) -> str:
    """``HATHAT``, else ``HATHAU``, else ``HATHAV``, even when that one exists.

    The recorded environment tries three ids only; a fourth booking replaces ``HATHAV``.
    """
    candidate = FIRST_RESERVATION_ID
    for _ in range(RESERVATION_IDS - 1):
        if docs.get("reservations", candidate) is None:
            return candidate
        candidate = _successor(candidate)
    return candidate


def _check_booking_payments(user: Doc, payments: list[Doc]) -> str | None:
    methods = user["payment_methods"]
    for payment in payments:
        method = methods.get(payment["payment_id"])
        if method is None:
            return f"Error: payment method {payment['payment_id']} not found"
        if (
            method["source"] in ("gift_card", "certificate")
            and method["amount"] < payment["amount"]
        ):
            return f"Error: not enough balance in payment method {payment['payment_id']}"
    return None


def book_reservation(docs: Documents, args: Mapping[str, Any]) -> str:
    """Book a new reservation, charging the given payment methods.

    Gift cards are debited; a certificate used is removed from the profile (its remainder
    is not refundable). Seat counts are not changed.
    """
    user = docs.get("users", args["user_id"])
    if user is None:
        return "Error: user not found"
    passengers = [dict(p) for p in args["passengers"]]
    legs: list[Doc] = []
    for wanted in args["flights"]:
        leg = _priced_leg(docs, wanted, args["cabin"], len(passengers))
        if isinstance(leg, str):
            return leg
        legs.append(leg)
    total = sum(leg["price"] for leg in legs) * len(passengers)
    if args["insurance"] == "yes":
        total += INSURANCE_PRICE * len(passengers)
    total += BAG_PRICE * args["nonfree_baggages"]
    payments = [dict(p) for p in args["payment_methods"]]
    refusal = _check_booking_payments(user, payments)
    if refusal is not None:
        return refusal
    paid = sum(p["amount"] for p in payments)
    if paid != total:
        return f"Error: payment amount does not add up, total price is {total}, but paid {paid}"
    for payment in payments:
        method = user["payment_methods"][payment["payment_id"]]
        if method["source"] == "gift_card":
            method["amount"] -= payment["amount"]
        elif method["source"] == "certificate":
            del user["payment_methods"][payment["payment_id"]]
    reservation_id = _new_reservation_id(docs)
    reservation = {
        "reservation_id": reservation_id,
        "user_id": args["user_id"],
        "origin": args["origin"],
        "destination": args["destination"],
        "flight_type": args["flight_type"],
        "cabin": args["cabin"],
        "flights": legs,
        "passengers": passengers,
        "payment_history": payments,
        "created_at": NOW,
        "total_baggages": args["total_baggages"],
        "nonfree_baggages": args["nonfree_baggages"],
        "insurance": args["insurance"],
    }
    user["reservations"].append(reservation_id)
    docs.put("reservations", reservation_id, reservation)
    docs.put("users", args["user_id"], user)
    return json.dumps(reservation)


def cancel_reservation(docs: Documents, args: Mapping[str, Any]) -> str:
    """Cancel a whole reservation: every payment gets a matching refund entry."""
    reservation = docs.get("reservations", args["reservation_id"])
    if reservation is None:
        return "Error: reservation not found"
    refunds = [
        {"payment_id": p["payment_id"], "amount": -p["amount"]}
        for p in reservation["payment_history"]
    ]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    docs.put("reservations", args["reservation_id"], reservation)
    return json.dumps(reservation)


def _charge(user: Doc, payment_id: str, amount: int | float) -> str | None:
    """Charge ``amount`` (negative: refund) to a method of ``user``; an error text if refused.

    A gift card's balance changes by the amount; a credit card's record does not change.
    """
    method = user["payment_methods"].get(payment_id)
    if method is None:
        return "Error: payment method not found"
    if method["source"] == "certificate":
        return "Error: certificate cannot be used to update reservation"
    if method["source"] == "gift_card":
        if method["amount"] < amount:
            return "Error: gift card balance is not enough"
        method["amount"] -= amount
    return None


def update_reservation_baggages(docs: Documents, args: Mapping[str, Any]) -> str:
    """Set the bag counts; each added non-free bag is charged to the payment method."""
    reservation = docs.get("reservations", args["reservation_id"])
    if reservation is None:
        return "Error: reservation not found"
    user = docs.get("users", reservation["user_id"])
    if user is None:
        return "Error: user not found"
    price = BAG_PRICE * max(0, args["nonfree_baggages"] - reservation["nonfree_baggages"])
    refusal = _charge(user, args["payment_id"], price)
    if refusal is not None:
        return refusal
    reservation["total_baggages"] = args["total_baggages"]
    reservation["nonfree_baggages"] = args["nonfree_baggages"]
    if price != 0:
        reservation["payment_history"].append({"payment_id": args["payment_id"], "amount": price})
    docs.put("reservations", args["reservation_id"], reservation)
    docs.put("users", reservation["user_id"], user)
    return json.dumps(reservation)


def _kept_leg(reservation: Doc, wanted: Mapping[str, Any], cabin: str) -> Doc | None:
    """The reservation's own leg for this flight and date, kept at its price, if any."""
    if cabin != reservation["cabin"]:
        return None
    for leg in reservation["flights"]:
        if leg["flight_number"] == wanted["flight_number"] and leg["date"] == wanted["date"]:
            return {
                **wanted,
                "price": leg["price"],
                "origin": leg["origin"],
                "destination": leg["destination"],
            }
    return None


def update_reservation_flights(docs: Documents, args: Mapping[str, Any]) -> str:
    """Replace the flights; the price difference is charged (or refunded) to one method.

    Legs kept from the reservation in the same cabin keep their price; other legs are priced
    now in the requested cabin. The reservation's ``cabin`` field is not changed.
    """
    reservation = docs.get("reservations", args["reservation_id"])
    if reservation is None:
        return "Error: reservation not found"
    user = docs.get("users", reservation["user_id"])
    if user is None:
        return "Error: user not found"
    seats = len(reservation["passengers"])
    legs: list[Doc] = []
    for wanted in args["flights"]:
        leg = _kept_leg(reservation, wanted, args["cabin"])
        if leg is None:
            priced = _priced_leg(docs, wanted, args["cabin"], seats)
            if isinstance(priced, str):
                return priced
            leg = priced
        legs.append(leg)
    difference = (
        sum(leg["price"] for leg in legs) - sum(leg["price"] for leg in reservation["flights"])
    ) * seats
    refusal = _charge(user, args["payment_id"], difference)
    if refusal is not None:
        return refusal
    reservation["flights"] = legs
    if difference != 0:
        reservation["payment_history"].append(
            {"payment_id": args["payment_id"], "amount": difference}
        )
    docs.put("reservations", args["reservation_id"], reservation)
    docs.put("users", reservation["user_id"], user)
    return json.dumps(reservation)


def update_reservation_passengers(docs: Documents, args: Mapping[str, Any]) -> str:
    """Replace the passengers' details; their number cannot change."""
    reservation = docs.get("reservations", args["reservation_id"])
    if reservation is None:
        return "Error: reservation not found"
    if len(args["passengers"]) != len(reservation["passengers"]):
        return "Error: number of passengers does not match"
    reservation["passengers"] = [dict(p) for p in args["passengers"]]
    docs.put("reservations", args["reservation_id"], reservation)
    return json.dumps(reservation)


def send_certificate(docs: Documents, args: Mapping[str, Any]) -> str:
    """Add a travel certificate of the given amount to the user's payment methods.

    The id is the first of ``certificate_3221322`` .. ``certificate_3221324`` the user does
    not hold. When the user holds all three, nothing is added and the output is empty (the
    recorded environment returned no text), as in docs/demo.md, "The environment's quirks".
    """
    user = docs.get("users", args["user_id"])
    if user is None:
        return "Error: user not found"
    methods = user["payment_methods"]
    for number in range(FIRST_CERTIFICATE_NUMBER, FIRST_CERTIFICATE_NUMBER + CERTIFICATE_IDS):
        certificate_id = f"certificate_{number}"
        if certificate_id in methods:
            continue
        methods[certificate_id] = {
            "source": "certificate",
            "amount": args["amount"],
            "id": certificate_id,
        }
        docs.put("users", args["user_id"], user)
        return (
            f"Certificate {certificate_id} added to user {args['user_id']} "
            f"with amount {args['amount']}."
        )
    return ""


# --------------------------------------------------------------------------- specs


def _string(description: str, enum: tuple[str, ...] = ()) -> dict[str, JSONValue]:
    schema: dict[str, JSONValue] = {"type": "string", "description": description}
    if enum:
        schema["enum"] = list(enum)
    return schema


def _object(properties: Mapping[str, JSONValue], description: str = "") -> dict[str, JSONValue]:
    schema: dict[str, JSONValue] = {
        "type": "object",
        "properties": dict(properties),
        "required": list(properties),
    }
    if description:
        schema["description"] = description
    return schema


def _array(items: Mapping[str, JSONValue], description: str) -> dict[str, JSONValue]:
    return {"type": "array", "description": description, "items": dict(items)}


def _spec(name: str, description: str, properties: Mapping[str, JSONValue]) -> ToolSpec:
    return ToolSpec(name=name, description=description, parameters=_object(properties))


_USER_ID = _string("The user id, such as 'sara_doe_496'.")
_RESERVATION_ID = _string("The reservation id, such as '8JX2WO'.")
_CABIN = _string("The cabin class.", ("basic_economy", "economy", "business"))
_PAYMENT_ID = _string(
    "The id of a gift card or credit card in the user's profile, such as "
    "'credit_card_7815826' or 'gift_card_7815826'."
)
_FLIGHT = _object(
    {
        "flight_number": _string("The flight number, such as 'HAT001'."),
        "date": _string("The date of the flight, formatted 'YYYY-MM-DD', such as '2024-05-01'."),
    }
)
_PASSENGER = _object(
    {
        "first_name": _string("The passenger's first name, such as 'Noah'."),
        "last_name": _string("The passenger's last name, such as 'Brown'."),
        "dob": _string("The passenger's date of birth, formatted 'YYYY-MM-DD'."),
    }
)
_PAYMENT = _object(
    {
        "payment_id": _string(
            "The id of a payment method in the user's profile, such as 'credit_card_7815826', "
            "'gift_card_7815826' or 'certificate_7815826'."
        ),
        "amount": {"type": "number", "description": "The amount to pay with this method."},
    }
)
_SEARCH = {
    "origin": _string("The IATA code of the origin airport, such as 'JFK'."),
    "destination": _string("The IATA code of the destination airport, such as 'LAX'."),
    "date": _string("The date of the flight, formatted 'YYYY-MM-DD', such as '2024-01-01'."),
}

TOOL_SPECS: Final[tuple[ToolSpec, ...]] = (
    _spec(
        "book_reservation",
        "Book a reservation.",
        {
            "user_id": _USER_ID,
            "origin": _string("The IATA code of the origin city, such as 'SFO'."),
            "destination": _string("The IATA code of the destination city, such as 'JFK'."),
            "flight_type": _string("The trip type.", ("one_way", "round_trip")),
            "cabin": _CABIN,
            "flights": _array(_FLIGHT, "The flights to book, one object per flight segment."),
            "passengers": _array(_PASSENGER, "The passengers, one object per passenger."),
            "payment_methods": _array(
                _PAYMENT, "The payment methods used to pay for the reservation."
            ),
            "total_baggages": {
                "type": "integer",
                "description": "The total number of checked bags in the reservation.",
            },
            "nonfree_baggages": {
                "type": "integer",
                "description": "The number of checked bags that are paid for.",
            },
            "insurance": _string("Whether travel insurance is bought.", ("yes", "no")),
        },
    ),
    _spec(
        "calculate",
        "Calculate the result of a mathematical expression.",
        {
            "expression": _string(
                "The expression to calculate, such as '2 + 2'. It may contain numbers, "
                "operators (+, -, *, /), parentheses and spaces."
            )
        },
    ),
    _spec(
        "cancel_reservation",
        "Cancel the whole reservation.",
        {"reservation_id": _RESERVATION_ID},
    ),
    _spec(
        "get_reservation_details",
        "Get the details of a reservation.",
        {"reservation_id": _RESERVATION_ID},
    ),
    _spec("get_user_details", "Get the details of a user.", {"user_id": _USER_ID}),
    _spec("list_all_airports", "List all airports and their cities.", {}),
    _spec("search_direct_flight", "Search direct flights between two cities on a date.", _SEARCH),
    _spec(
        "search_onestop_flight",
        "Search flights with one stop between two cities on a date.",
        _SEARCH,
    ),
    _spec(
        "send_certificate",
        "Send a certificate to a user. Be careful!",
        {
            "user_id": _string(
                "The id of the user to send the certificate to, such as 'sara_doe_496'."
            ),
            "amount": {"type": "number", "description": "The certificate amount to send."},
        },
    ),
    _spec(
        "think",
        "Use the tool to think about something. It will not obtain new information or change "
        "the database, but just append the thought to the log. Use it when complex reasoning "
        "is needed.",
        {"thought": _string("A thought to think about.")},
    ),
    _spec(
        "transfer_to_human_agents",
        "Transfer the user to a human agent, with a summary of the user's issue. Only transfer "
        "if the user explicitly asks for a human agent, or if the user's issue cannot be "
        "resolved by the agent with the available tools.",
        {"summary": _string("A summary of the user's issue.")},
    ),
    _spec(
        "update_reservation_baggages",
        "Update the baggage information of a reservation.",
        {
            "reservation_id": _RESERVATION_ID,
            "total_baggages": {
                "type": "integer",
                "description": "The updated total number of checked bags.",
            },
            "nonfree_baggages": {
                "type": "integer",
                "description": "The updated number of checked bags that are paid for.",
            },
            "payment_id": _PAYMENT_ID,
        },
    ),
    _spec(
        "update_reservation_flights",
        "Update the flight information of a reservation.",
        {
            "reservation_id": _RESERVATION_ID,
            "cabin": _CABIN,
            "flights": _array(
                _FLIGHT,
                "All flight segments of the reservation after the update, including the "
                "segments that do not change.",
            ),
            "payment_id": _PAYMENT_ID,
        },
    ),
    _spec(
        "update_reservation_passengers",
        "Update the passenger information of a reservation.",
        {
            "reservation_id": _RESERVATION_ID,
            "passengers": _array(_PASSENGER, "The passengers, one object per passenger."),
        },
    ),
)
"""The 14 tools as the model sees them, in alphabetical order."""

# --------------------------------------------------------------------------- validation


def _problem(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    """What is wrong with ``value`` under the (small) JSON-schema subset used here."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: must be one of {', '.join(map(repr, schema['enum']))}, got {value!r}"
    if kind == "object":
        return _object_problem(schema, value, where)
    if kind == "array":
        if not isinstance(value, list):
            return f"{where}: expected an array, got {type(value).__name__}"
        for i, item in enumerate(value):
            found = _problem(schema["items"], item, f"{where}[{i}]")
            if found:
                return found
        return None
    expected: dict[str, tuple[type, ...]] = {
        "string": (str,),
        "integer": (int,),
        "number": (int, float),
    }
    if kind in expected:
        ok = isinstance(value, expected[kind]) and not isinstance(value, bool)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if not ok:
            return f"{where}: expected {kind}, got {value!r}"
    return None


def _object_problem(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    if not isinstance(value, Mapping):
        return f"{where}: expected an object, got {type(value).__name__}"
    prefix = f"{where}." if where else ""
    properties = schema.get("properties", {})
    for key in schema.get("required", ()):
        if key not in value:
            return f"{prefix}{key}: missing"
    for key, item in value.items():
        if key not in properties:
            if where:
                # Inside a flight, passenger or payment the recorded environment keeps
                # unknown keys (a flight's price, origin and destination are overwritten).
                continue
            return f"{prefix}{key}: unexpected argument"
        found = _problem(properties[key], item, f"{prefix}{key}")
        if found:
            return found
    return None


# --------------------------------------------------------------------------- dispatch


@attrs.frozen(kw_only=True)
class _Tool:
    spec: ToolSpec
    run: Callable[[Documents, Mapping[str, Any]], str]
    writes: bool


_RUNNERS: Final[Mapping[str, Callable[[Documents, Mapping[str, Any]], str]]] = {
    "book_reservation": book_reservation,
    "calculate": calculate,
    "cancel_reservation": cancel_reservation,
    "get_reservation_details": get_reservation_details,
    "get_user_details": get_user_details,
    "list_all_airports": list_all_airports,
    "search_direct_flight": search_direct_flight,
    "search_onestop_flight": search_onestop_flight,
    "send_certificate": send_certificate,
    "think": think,
    "transfer_to_human_agents": transfer_to_human_agents,
    "update_reservation_baggages": update_reservation_baggages,
    "update_reservation_flights": update_reservation_flights,
    "update_reservation_passengers": update_reservation_passengers,
}

WRITE_TOOLS: Final = frozenset(
    {
        "book_reservation",
        "cancel_reservation",
        "send_certificate",
        "update_reservation_baggages",
        "update_reservation_flights",
        "update_reservation_passengers",
    }
)
"""The six tools that change the database (idempotent per intent id)."""

TERMINAL_TOOLS: Final = frozenset({"transfer_to_human_agents"})
"""Tools whose call ends the conversation (the environment's completion signal)."""

_TOOLS: Final[Mapping[str, _Tool]] = {
    spec.name: _Tool(spec=spec, run=_RUNNERS[spec.name], writes=spec.name in WRITE_TOOLS)
    for spec in TOOL_SPECS
}


def validate_arguments(tool: str, arguments: Any) -> None:
    """Check a call against the tool's parameter schema.

    Args:
        tool: the tool name.
        arguments: the decoded JSON arguments.

    Raises:
        UnknownToolError: when ``tool`` is not an airline tool.
        InvalidArgumentsError: when an argument is missing, unexpected or of the wrong type.
    """
    found = _TOOLS.get(tool)
    if found is None:
        raise UnknownToolError(tool)
    problem = _problem(found.spec.parameters, arguments, "")
    if problem is not None:
        raise InvalidArgumentsError(tool, problem.removeprefix(": "))


def run_tool(db: AirlineDatabase, tool: str, arguments: Any, intent_id: str) -> str:
    """Run one airline tool call.

    Read tools run in one read transaction. Write tools run in one write transaction that
    also records ``intent_id`` in ``applied_actions``: when the key was already applied,
    the stored output is returned and nothing changes. A refusal (``Error: ...``) is an
    applied outcome too and is stored the same way.

    Args:
        db: the conversation's database.
        tool: the tool name.
        arguments: the decoded JSON arguments.
        intent_id: the idempotency key (the action intent id); required, also for reads.

    Returns:
        The tool's output text.

    Raises:
        UnknownToolError: when ``tool`` is not an airline tool.
        InvalidArgumentsError: when the arguments do not match the tool's schema.
        IntentConflictError: when ``intent_id`` was applied by a different write tool.
        sqlite3.Error: when the database fails; the transaction is rolled back.
    """
    validate_arguments(tool, arguments)
    entry = _TOOLS[tool]
    with db.transaction(write=entry.writes) as docs:
        if not entry.writes:
            return entry.run(docs, arguments)
        applied = docs.applied(intent_id)
        if applied is not None:
            applied_tool, output = applied
            if applied_tool != tool:
                raise IntentConflictError(intent_id, applied_tool=applied_tool, tool=tool)
            return output
        output = entry.run(docs, arguments)
        docs.record_applied(intent_id, tool, output)
        return output


class AirlineTools:
    """The airline environment of one conversation: its database, tools and specs.

    Attributes:
        db: the conversation's database.
        specs: the 14 tool specs, in declaration order.
    """

    specs: tuple[ToolSpec, ...] = TOOL_SPECS

    def __init__(self, db: AirlineDatabase) -> None:
        self.db = db

    def call(self, tool: str, arguments: Any, intent_id: str) -> str:
        """Run one tool call; see `run_tool` for behaviour and errors."""
        return run_tool(self.db, tool, arguments, intent_id)

    @staticmethod
    def is_write(tool: str) -> bool:
        """True for the six database-changing tools."""
        return tool in WRITE_TOOLS

    @staticmethod
    def ends_conversation(tool: str) -> bool:
        """True when a call of ``tool`` ends the conversation (a transfer to a human)."""
        return tool in TERMINAL_TOOLS
