"""The airline tools: recorded-output reproduction, behaviour, idempotency, data lookup."""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from treadle.demo.airline import data as data_mod
from treadle.demo.airline.data import (
    AirlineData,
    AirlineDataNotFound,
    align_users,
    find_data_dir,
    load_data,
    load_recordings,
)
from treadle.demo.airline.db import AirlineDatabase, Documents, reconcile
from treadle.demo.airline.scoring import replay_tool_calls
from treadle.demo.airline.tools import (
    TOOL_SPECS,
    WRITE_TOOLS,
    AirlineTools,
    IntentConflictError,
    InvalidArgumentsError,
    UnknownToolError,
    run_tool,
)
from treadle.types import ToolSpec

# --------------------------------------------------------------------------- fixtures


def _workload_dir() -> Path:
    try:
        return find_data_dir()
    except AirlineDataNotFound:
        if os.environ.get("CI"):
            raise
        pytest.skip("airline workload data not found (set TREADLE_AIRLINE_DATA)")


@pytest.fixture(scope="module")
def workload() -> Path:
    return _workload_dir()


@pytest.fixture(scope="module")
def fresh_real(workload: Path, tmp_path_factory: pytest.TempPathFactory) -> AirlineDatabase:
    folder = tmp_path_factory.mktemp("airline-real")
    return AirlineDatabase.create(folder / "fresh.sqlite3", load_data(workload))


USER: dict[str, Any] = {
    "name": {"first_name": "Ann", "last_name": "Lee"},
    "address": {
        "address1": "1 Main St",
        "address2": "Suite 1",
        "city": "Austin",
        "country": "USA",
        "province": "TX",
        "zip": "78701",
    },
    "email": "ann@example.com",
    "dob": "1990-01-01",
    "payment_methods": {
        "credit_card_1": {
            "source": "credit_card",
            "brand": "visa",
            "last_four": "1111",
            "id": "credit_card_1",
        },
        "gift_card_1": {"source": "gift_card", "amount": 100, "id": "gift_card_1"},
        "certificate_1": {"source": "certificate", "amount": 50, "id": "certificate_1"},
    },
    "saved_passengers": [],
    "membership": "gold",
    "reservations": ["RES001"],
}

RESERVATION: dict[str, Any] = {
    "reservation_id": "RES001",
    "user_id": "ann_lee_1",
    "origin": "JFK",
    "destination": "LAX",
    "flight_type": "one_way",
    "cabin": "economy",
    "flights": [
        {
            "origin": "JFK",
            "destination": "LAX",
            "flight_number": "HAT001",
            "date": "2024-05-20",
            "price": 100,
        }
    ],
    "passengers": [{"first_name": "Ann", "last_name": "Lee", "dob": "1990-01-01"}],
    "payment_history": [{"payment_id": "credit_card_1", "amount": 100}],
    "created_at": "2024-05-01T10:00:00",
    "total_baggages": 0,
    "nonfree_baggages": 0,
    "insurance": "no",
}


def _day(seats: int, prices: tuple[int, int, int]) -> dict[str, Any]:
    return {
        "status": "available",
        "available_seats": {"basic_economy": seats, "economy": seats, "business": seats},
        "prices": dict(zip(("basic_economy", "economy", "business"), prices, strict=True)),
    }


def _flight(number: str, route: str, times: str, dates: dict[str, Any]) -> dict[str, Any]:
    origin, destination = route.split("-")
    departure, arrival = times.split("/")
    return {
        "flight_number": number,
        "origin": origin,
        "destination": destination,
        "scheduled_departure_time_est": departure,
        "scheduled_arrival_time_est": arrival,
        "dates": dates,
    }


FLIGHTS: dict[str, Any] = {
    "HAT001": _flight(
        "HAT001",
        "JFK-LAX",
        "08:00:00/11:00:00",
        {"2024-05-20": _day(5, (50, 120, 400)), "2024-05-21": _day(1, (60, 130, 410))},
    ),
    "HAT002": _flight(
        "HAT002", "JFK-ORD", "22:00:00/01:00:00+1", {"2024-05-20": _day(9, (40, 90, 300))}
    ),
    "HAT003": _flight(
        "HAT003",
        "ORD-LAX",
        "06:00:00/09:00:00",
        {"2024-05-20": _day(9, (41, 91, 301)), "2024-05-21": _day(9, (42, 92, 302))},
    ),
    "HAT004": _flight(
        "HAT004", "JFK-LAX", "09:00:00/12:00:00", {"2024-05-20": {"status": "delayed"}}
    ),
}


def small_data() -> AirlineData:
    return AirlineData(
        users={"ann_lee_1": copy.deepcopy(USER)},
        reservations={"RES001": copy.deepcopy(RESERVATION)},
        flights=copy.deepcopy(FLIGHTS),
    )


@pytest.fixture
def db(tmp_path: Path) -> AirlineDatabase:
    return AirlineDatabase.create(tmp_path / "small.sqlite3", small_data())


def call(db: AirlineDatabase, tool: str, intent: str = "i-1", **arguments: Any) -> str:
    return run_tool(db, tool, arguments, intent)


def user(db: AirlineDatabase) -> dict[str, Any]:
    return db.snapshot()["users"]["ann_lee_1"]  # type: ignore[no-any-return]


def reservation(db: AirlineDatabase, key: str = "RES001") -> dict[str, Any]:
    return db.snapshot()["reservations"][key]  # type: ignore[no-any-return]


BOOKING: dict[str, Any] = {
    "user_id": "ann_lee_1",
    "origin": "JFK",
    "destination": "LAX",
    "flight_type": "one_way",
    "cabin": "economy",
    "flights": [{"flight_number": "HAT001", "date": "2024-05-20"}],
    "passengers": [{"first_name": "Ann", "last_name": "Lee", "dob": "1990-01-01"}],
    "payment_methods": [
        {"payment_id": "gift_card_1", "amount": 100},
        {"payment_id": "credit_card_1", "amount": 20},
    ],
    "total_baggages": 1,
    "nonfree_baggages": 0,
    "insurance": "no",
}


def booking(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BOOKING), **changes}


# --------------------------------------------------------------------------- recordings


def test_recorded_tool_outputs_are_reproduced(workload: Path, fresh_real: AirlineDatabase):
    """Every recorded tool call, replayed in order from the recorded initial data, gives
    exactly the recorded observation. Every write tool but update_reservation_passengers
    (which no recording calls; its unit tests are below) is among them."""
    total, mismatches, tools = 0, {}, set()
    for rec in load_recordings(workload):
        db = fresh_real.copy_to(fresh_real.path.parent / f"{rec.name}.sqlite3")
        for replayed in replay_tool_calls(rec, db):
            total += 1
            tools.add(replayed.tool)
            if not replayed.matches:
                mismatches[rec.name, replayed.index] = (
                    f"{rec.name} call {replayed.index} {replayed.tool}: "
                    f"{replayed.error or replayed.output!r:.300} != {replayed.recorded!r:.300}"
                )
    assert total >= 500
    assert not mismatches, "\n".join(mismatches.values())
    assert WRITE_TOOLS - tools == {"update_reservation_passengers"}


# --------------------------------------------------------------------------- read tools


def test_read_tools_return_stored_json(db: AirlineDatabase):
    assert call(db, "get_user_details", user_id="ann_lee_1") == json.dumps(USER)
    assert call(db, "get_reservation_details", reservation_id="RES001") == json.dumps(RESERVATION)
    assert call(db, "get_user_details", user_id="nobody") == "Error: user not found"
    # the recorded environment's text for a missing reservation
    assert call(db, "get_reservation_details", reservation_id="NOPE") == "Error: user not found"
    airports = json.loads(call(db, "list_all_airports"))
    assert list(airports)[:3] == ["SFO", "JFK", "LAX"] and len(airports) == 20


def test_search_direct_lists_only_available_flights(db: AirlineDatabase):
    found = json.loads(
        call(db, "search_direct_flight", origin="JFK", destination="LAX", date="2024-05-20")
    )
    assert [f["flight_number"] for f in found] == ["HAT001"]  # HAT004 is delayed
    assert list(found[0]) == [
        "flight_number",
        "origin",
        "destination",
        "scheduled_departure_time_est",
        "scheduled_arrival_time_est",
        "status",
        "available_seats",
        "prices",
    ]
    none = call(db, "search_direct_flight", origin="JFK", destination="LAX", date="2024-06-01")
    assert none == "[]"


def test_search_onestop_next_day_label_is_unpadded_may_and_must_exist(db: AirlineDatabase):
    """The overnight label is ``2024-05-`` + (day + 1), unpadded: the 5th gives ``2024-05-6``,
    which no flight has, so no overnight connection is found; the 9th gives ``2024-05-10``."""
    flights = copy.deepcopy(FLIGHTS)
    for number in ("HAT002", "HAT003"):
        for day in ("2024-05-05", "2024-05-06", "2024-05-09", "2024-05-10"):
            flights[number]["dates"][day] = _day(9, (40, 90, 300))
    data = AirlineData(users={}, reservations={}, flights=flights)
    quirky = AirlineDatabase.create(db.path.parent / "quirky.sqlite3", data)
    search = {"origin": "JFK", "destination": "LAX"}
    assert run_tool(quirky, "search_onestop_flight", {**search, "date": "2024-05-05"}, "a") == "[]"
    found = json.loads(
        run_tool(quirky, "search_onestop_flight", {**search, "date": "2024-05-09"}, "b")
    )
    assert [[leg["date"] for leg in pair] for pair in found] == [["2024-05-09", "2024-05-10"]]
    # the month is ignored, and the second leg must be available on its own date
    assert run_tool(quirky, "search_onestop_flight", {**search, "date": "2024-06-09"}, "c") == "[]"
    flights["HAT003"]["dates"]["2024-05-10"] = {"status": "cancelled"}
    cancelled = AirlineDatabase.create(db.path.parent / "cancelled.sqlite3", data)
    assert (
        run_tool(cancelled, "search_onestop_flight", {**search, "date": "2024-05-09"}, "d") == "[]"
    )


def test_search_onestop_fails_as_recorded_when_second_leg_lacks_search_day(db: AirlineDatabase):
    flights = copy.deepcopy(FLIGHTS)
    flights["HAT003"]["dates"] = {"2024-05-21": _day(9, (42, 92, 302))}
    data = AirlineData(users={}, reservations={}, flights=flights)
    odd = AirlineDatabase.create(db.path.parent / "odd.sqlite3", data)
    out = run_tool(
        odd,
        "search_onestop_flight",
        {"origin": "JFK", "destination": "LAX", "date": "2024-05-20"},
        "a",
    )
    assert out == "Error: '2024-05-20'"


def test_search_onestop_uses_next_day_label_with_search_day_prices(db: AirlineDatabase):
    found = json.loads(
        call(db, "search_onestop_flight", origin="JFK", destination="LAX", date="2024-05-20")
    )
    assert len(found) == 1
    first, second = found[0]
    assert (first["flight_number"], first["date"]) == ("HAT002", "2024-05-20")
    assert (second["flight_number"], second["date"]) == ("HAT003", "2024-05-21")
    # as recorded: the second leg shows the search day's prices
    assert second["prices"] == {"basic_economy": 41, "economy": 91, "business": 301}


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("3 * 2", "6.0"),
        ("(350 - 122) * 2 + (499 - 127) * 2", "1200.0"),
        ("498 * 1.5", "747.0"),
        ("(136 - (94 + 80)) * 3", "-114.0"),
        ("10 / 3", "3.33"),
        ("  1 + 1", "2.0"),
        ("1 / 0", "Error: division by zero"),
        ("2 ** 3", "8.0"),
        ("2 ** 99999", "Error: exponent too large"),
        ("1 +", "Error: invalid syntax (<string>, line 1)"),
        ("__import__('os')", "Error: invalid characters in expression"),
        ("2 % 3", "Error: invalid characters in expression"),
    ],
)
def test_calculate(db: AirlineDatabase, expression: str, expected: str):
    assert call(db, "calculate", expression=expression) == expected


def test_think_and_transfer(db: AirlineDatabase):
    assert call(db, "think", thought="hmm") == ""
    assert call(db, "transfer_to_human_agents", summary="help") == "Transfer successful"
    assert AirlineTools.ends_conversation("transfer_to_human_agents")
    assert not AirlineTools.ends_conversation("think")


# --------------------------------------------------------------------------- write tools


def test_book_reservation_charges_and_stores(db: AirlineDatabase):
    out = json.loads(call(db, "book_reservation", **booking()))
    assert out["reservation_id"] == "HATHAT"
    assert out["created_at"] == "2024-05-15T15:00:00"
    assert out["flights"] == [
        {
            "flight_number": "HAT001",
            "date": "2024-05-20",
            "price": 120,
            "origin": "JFK",
            "destination": "LAX",
        }
    ]
    assert reservation(db, "HATHAT") == out
    assert user(db)["payment_methods"]["gift_card_1"]["amount"] == 0
    assert user(db)["reservations"] == ["RES001", "HATHAT"]
    # seat counts are not changed by a booking (as in the recorded environment)
    assert db.snapshot()["flights"] == FLIGHTS


def test_book_reservation_total_includes_insurance_and_bags(db: AirlineDatabase):
    args = booking(
        insurance="yes",
        nonfree_baggages=2,
        payment_methods=[{"payment_id": "credit_card_1", "amount": 120}],
    )
    assert call(db, "book_reservation", **args) == (
        "Error: payment amount does not add up, total price is 250, but paid 120"
    )
    args["payment_methods"] = [
        {"payment_id": "certificate_1", "amount": 50},
        {"payment_id": "credit_card_1", "amount": 200},
    ]
    booked = json.loads(call(db, "book_reservation", "i-2", **args))
    assert booked["payment_history"] == args["payment_methods"]
    assert "certificate_1" not in user(db)["payment_methods"]  # a used certificate is gone


def test_book_reservation_second_booking_gets_next_id(db: AirlineDatabase):
    json.loads(call(db, "book_reservation", "i-1", **booking()))
    pay = [{"payment_id": "credit_card_1", "amount": 120}]
    second = json.loads(call(db, "book_reservation", "i-2", **booking(payment_methods=pay)))
    assert second["reservation_id"] == "HATHAU"


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"user_id": "nobody"}, "Error: user not found"),
        (
            {"flights": [{"flight_number": "HAT999", "date": "2024-05-20"}]},
            "Error: flight HAT999 not found",
        ),
        (
            {"flights": [{"flight_number": "HAT001", "date": "2024-07-01"}]},
            "Error: flight HAT001 not found on date 2024-07-01",
        ),
        (
            {"flights": [{"flight_number": "HAT004", "date": "2024-05-20"}]},
            "Error: flight HAT004 not available on date 2024-05-20",
        ),
        (
            {"payment_methods": [{"payment_id": "gift_card_9", "amount": 120}]},
            "Error: payment method gift_card_9 not found",
        ),
        (
            {"payment_methods": [{"payment_id": "gift_card_1", "amount": 120}]},
            "Error: not enough balance in payment method gift_card_1",
        ),
    ],
)
def test_book_reservation_refusals_change_nothing(
    db: AirlineDatabase, changes: dict[str, Any], error: str
):
    before = db.snapshot()
    assert call(db, "book_reservation", **booking(**changes)) == error
    assert db.snapshot() == before


def test_book_reservation_not_enough_seats(db: AirlineDatabase):
    two = [
        {"first_name": "Ann", "last_name": "Lee", "dob": "1990-01-01"},
        {"first_name": "Bo", "last_name": "Lee", "dob": "1991-01-01"},
    ]
    args = booking(flights=[{"flight_number": "HAT001", "date": "2024-05-21"}], passengers=two)
    assert call(db, "book_reservation", **args) == "Error: not enough seats on flight HAT001"


def test_cancel_reservation_adds_refunds_and_status(db: AirlineDatabase):
    out = json.loads(call(db, "cancel_reservation", reservation_id="RES001"))
    assert out["status"] == "cancelled"
    assert out["payment_history"] == [
        {"payment_id": "credit_card_1", "amount": 100},
        {"payment_id": "credit_card_1", "amount": -100},
    ]
    assert reservation(db) == out
    assert call(db, "cancel_reservation", "i-2", reservation_id="NOPE") == (
        "Error: reservation not found"
    )


def test_update_baggages_charges_new_nonfree_bags(db: AirlineDatabase):
    out = json.loads(
        call(
            db,
            "update_reservation_baggages",
            reservation_id="RES001",
            total_baggages=3,
            nonfree_baggages=1,
            payment_id="gift_card_1",
        )
    )
    assert (out["total_baggages"], out["nonfree_baggages"]) == (3, 1)
    assert out["payment_history"][-1] == {"payment_id": "gift_card_1", "amount": 50}
    assert user(db)["payment_methods"]["gift_card_1"]["amount"] == 50


@pytest.mark.parametrize(
    ("payment_id", "nonfree", "error"),
    [
        ("gift_card_9", 1, "Error: payment method not found"),
        ("certificate_1", 1, "Error: certificate cannot be used to update reservation"),
        ("gift_card_1", 3, "Error: gift card balance is not enough"),
    ],
)
def test_update_baggages_refusals(db: AirlineDatabase, payment_id: str, nonfree: int, error: str):
    before = db.snapshot()
    out = call(
        db,
        "update_reservation_baggages",
        reservation_id="RES001",
        total_baggages=3,
        nonfree_baggages=nonfree,
        payment_id=payment_id,
    )
    assert out == error
    assert db.snapshot() == before


def test_update_flights_keeps_same_cabin_legs_at_their_price(db: AirlineDatabase):
    legs = [{"flight_number": "HAT001", "date": "2024-05-20"}]
    out = json.loads(
        call(
            db,
            "update_reservation_flights",
            reservation_id="RES001",
            cabin="economy",
            flights=legs,
            payment_id="credit_card_1",
        )
    )
    assert out["flights"][0]["price"] == 100  # kept at the booked price, not 120 now
    assert out["payment_history"] == RESERVATION["payment_history"]  # nothing to pay


def test_update_flights_reprices_on_cabin_change_and_keeps_cabin_field(db: AirlineDatabase):
    legs = [{"flight_number": "HAT001", "date": "2024-05-20"}]
    out = json.loads(
        call(
            db,
            "update_reservation_flights",
            reservation_id="RES001",
            cabin="business",
            flights=legs,
            payment_id="credit_card_1",
        )
    )
    assert out["flights"][0]["price"] == 400
    assert out["payment_history"][-1] == {"payment_id": "credit_card_1", "amount": 300}
    assert out["cabin"] == "economy"  # as in the recorded environment


def test_update_flights_refund_goes_to_gift_card(db: AirlineDatabase):
    legs = [{"flight_number": "HAT003", "date": "2024-05-21"}]
    out = json.loads(
        call(
            db,
            "update_reservation_flights",
            reservation_id="RES001",
            cabin="basic_economy",
            flights=legs,
            payment_id="gift_card_1",
        )
    )
    assert out["payment_history"][-1] == {"payment_id": "gift_card_1", "amount": -58}
    assert user(db)["payment_methods"]["gift_card_1"]["amount"] == 158


def test_update_passengers(db: AirlineDatabase):
    new = [{"first_name": "Zed", "last_name": "Lee", "dob": "1980-02-02"}]
    out = json.loads(
        call(db, "update_reservation_passengers", reservation_id="RES001", passengers=new)
    )
    assert out["passengers"] == new
    two = new * 2
    assert call(
        db, "update_reservation_passengers", "i-2", reservation_id="RES001", passengers=two
    ) == ("Error: number of passengers does not match")


def test_send_certificate_ids_count_up_per_user(db: AirlineDatabase):
    first = call(db, "send_certificate", "i-1", user_id="ann_lee_1", amount=150)
    second = call(db, "send_certificate", "i-2", user_id="ann_lee_1", amount=50)
    assert first == "Certificate certificate_3221322 added to user ann_lee_1 with amount 150."
    assert second == "Certificate certificate_3221323 added to user ann_lee_1 with amount 50."
    assert user(db)["payment_methods"]["certificate_3221322"] == {
        "source": "certificate",
        "amount": 150,
        "id": "certificate_3221322",
    }
    assert call(db, "send_certificate", "i-3", user_id="x", amount=1) == "Error: user not found"


def test_send_certificate_tries_three_ids_then_adds_nothing(db: AirlineDatabase):
    for n in range(3):
        assert call(db, "send_certificate", f"i-{n}", user_id="ann_lee_1", amount=10).startswith(
            f"Certificate certificate_322132{2 + n} added"
        )
    before = db.snapshot()
    assert call(db, "send_certificate", "i-4", user_id="ann_lee_1", amount=10) == ""
    assert db.snapshot()["users"] == before["users"]


def test_fourth_booking_replaces_hathav(db: AirlineDatabase):
    pay = [{"payment_id": "credit_card_1", "amount": 120}]
    ids = [
        json.loads(call(db, "book_reservation", f"i-{n}", **booking(payment_methods=pay)))[
            "reservation_id"
        ]
        for n in range(4)
    ]
    assert ids == ["HATHAT", "HATHAU", "HATHAV", "HATHAV"]
    assert user(db)["reservations"] == ["RES001", "HATHAT", "HATHAU", "HATHAV", "HATHAV"]


def test_nested_unknown_keys_are_kept_and_price_is_overwritten(db: AirlineDatabase):
    """As recorded: a flight object may carry more keys; price, origin and destination are
    set by the environment in place, the others kept where the model put them."""
    legs = [{"flight_number": "HAT003", "price": 1, "date": "2024-05-21", "note": "x"}]
    out = call(
        db,
        "update_reservation_flights",
        reservation_id="RES001",
        cabin="economy",
        flights=legs,
        payment_id="credit_card_1",
    )
    leg = json.loads(out)["flights"][0]
    assert list(leg) == ["flight_number", "price", "date", "note", "origin", "destination"]
    assert leg["price"] == 92
    assert '"flight_number": "HAT003", "price": 92, "date": "2024-05-21"' in out


def test_flight_change_with_price_difference_exact_observation(db: AirlineDatabase):
    """A change to a dearer flight: the difference per passenger times passengers is one
    payment entry, the gift card pays it, the cabin field stays, and the observation is the
    reservation as ``json.dumps`` writes it (keys in stored order, ", " and ": ")."""
    legs = [{"flight_number": "HAT001", "date": "2024-05-21"}]
    out = call(
        db,
        "update_reservation_flights",
        reservation_id="RES001",
        cabin="economy",
        flights=legs,
        payment_id="gift_card_1",
    )
    expected = copy.deepcopy(RESERVATION)
    expected["flights"] = [
        {
            "flight_number": "HAT001",
            "date": "2024-05-21",
            "price": 130,
            "origin": "JFK",
            "destination": "LAX",
        }
    ]
    expected["payment_history"].append({"payment_id": "gift_card_1", "amount": 30})
    assert out == json.dumps(expected)
    assert user(db)["payment_methods"]["gift_card_1"]["amount"] == 70
    # a later write shows the changed reservation as stored
    bags = call(
        db,
        "update_reservation_baggages",
        "i-2",
        reservation_id="RES001",
        total_baggages=0,
        nonfree_baggages=0,
        payment_id="credit_card_1",
    )
    assert bags == out


# --------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize(
    ("tool", "arguments", "problem"),
    [
        ("get_user_details", {}, "user_id: missing"),
        ("get_user_details", {"user_id": 7}, "user_id: expected string, got 7"),
        ("get_user_details", {"user_id": "a", "x": 1}, "x: unexpected argument"),
        ("get_user_details", ["a"], "expected an object, got list"),
        ("send_certificate", {"user_id": "a", "amount": True}, "amount: expected number"),
        ("book_reservation", booking(total_baggages=1.0), "total_baggages: expected integer"),
        ("book_reservation", booking(cabin="first"), "cabin: must be one of"),
        ("book_reservation", booking(passengers=[{}]), "passengers[0].first_name: missing"),
        ("book_reservation", booking(flights={}), "flights: expected an array, got dict"),
    ],
)
def test_invalid_arguments_raise_and_change_nothing(
    db: AirlineDatabase, tool: str, arguments: Any, problem: str
):
    before = db.snapshot()
    with pytest.raises(InvalidArgumentsError) as info:
        run_tool(db, tool, arguments, "i-1")
    assert info.value.tool == tool
    assert problem in info.value.problem
    assert db.snapshot() == before
    assert reconcile(db, "i-1") is None


def test_unknown_tool_raises(db: AirlineDatabase):
    with pytest.raises(UnknownToolError) as info:
        run_tool(db, "delete_everything", {}, "i-1")
    assert info.value.tool == "delete_everything"


def test_specs_cover_the_fourteen_tools():
    names = [spec.name for spec in TOOL_SPECS]
    assert len(names) == 14 == len(set(names))
    assert set(names) > WRITE_TOOLS and len(WRITE_TOOLS) == 6
    for spec in TOOL_SPECS:
        assert isinstance(spec, ToolSpec)
        assert spec.description
        params = spec.parameters
        assert params["type"] == "object"
        assert set(params["required"]) == set(params["properties"])
    assert AirlineTools.specs == TOOL_SPECS


# --------------------------------------------------------------------------- idempotency


def test_same_intent_twice_applies_once(db: AirlineDatabase):
    first = call(db, "send_certificate", "intent-7", user_id="ann_lee_1", amount=100)
    after_first = db.snapshot()
    again = call(db, "send_certificate", "intent-7", user_id="ann_lee_1", amount=100)
    assert again == first
    assert db.snapshot() == after_first
    assert [m for m in user(db)["payment_methods"] if m.startswith("certificate_32")] == [
        "certificate_3221322"
    ]


def test_same_intent_returns_stored_output_even_with_other_arguments(db: AirlineDatabase):
    first = call(db, "cancel_reservation", "intent-1", reservation_id="RES001")
    assert call(db, "cancel_reservation", "intent-1", reservation_id="OTHER") == first
    assert len(reservation(db)["payment_history"]) == 2  # refunded once


def test_refusal_is_an_applied_outcome(db: AirlineDatabase):
    out = call(db, "cancel_reservation", "intent-1", reservation_id="NOPE")
    assert out == "Error: reservation not found"
    assert reconcile(db, "intent-1") == out


def test_intent_reused_by_another_tool_is_refused(db: AirlineDatabase):
    call(db, "cancel_reservation", "intent-1", reservation_id="RES001")
    with pytest.raises(IntentConflictError):
        call(db, "send_certificate", "intent-1", user_id="ann_lee_1", amount=1)


def test_reconcile_reports_applied_output_only(db: AirlineDatabase):
    assert reconcile(db, "intent-1") is None
    out = call(db, "update_reservation_baggages", "intent-1", reservation_id="RES001",
               total_baggages=1, nonfree_baggages=0, payment_id="credit_card_1")  # fmt: skip
    assert reconcile(db, "intent-1") == out
    assert db.applied_actions() == [("intent-1", "update_reservation_baggages", out)]
    call(db, "get_user_details", "intent-2", user_id="ann_lee_1")
    assert reconcile(db, "intent-2") is None  # reads are not recorded


def test_failure_inside_a_write_rolls_back_everything(
    db: AirlineDatabase, monkeypatch: pytest.MonkeyPatch
):
    before = db.snapshot()

    def broken(self: Documents, intent_id: str, tool: str, output: str) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Documents, "record_applied", broken)
    with pytest.raises(sqlite3.OperationalError):
        call(db, "book_reservation", "intent-1", **booking())
    monkeypatch.undo()
    assert db.snapshot() == before
    assert reconcile(db, "intent-1") is None
    assert json.loads(call(db, "book_reservation", "intent-1", **booking()))["reservation_id"]


def test_concurrent_calls_with_one_intent_apply_once(db: AirlineDatabase):
    outputs: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        out = run_tool(db, "send_certificate", {"user_id": "ann_lee_1", "amount": 5}, "same")
        with lock:
            outputs.append(out)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outputs) == 6 and len(set(outputs)) == 1
    assert sum(m.startswith("certificate_32") for m in user(db)["payment_methods"]) == 1


def test_database_files_are_never_overwritten(db: AirlineDatabase, tmp_path: Path):
    with pytest.raises(FileExistsError):
        AirlineDatabase.create(db.path, small_data())
    with pytest.raises(FileExistsError):
        db.copy_to(db.path)
    copy_ = db.copy_to(tmp_path / "copy.sqlite3")
    assert copy_.data_hash() == db.data_hash()
    with pytest.raises(FileNotFoundError):
        run_tool(AirlineDatabase(tmp_path / "missing.sqlite3"), "think", {"thought": ""}, "i")


# --------------------------------------------------------------------------- data lookup


def test_align_users_renames_state_in_place():
    users = {
        "a": {"name": "x", "address": {"city": "Austin", "state": "TX", "zip": "1"}},
        "b": {"address": {"city": "Reno", "province": "NV"}},
        "c": {"address": None},
    }
    original = copy.deepcopy(users)
    aligned = align_users(users)
    assert list(aligned["a"]["address"].items()) == [
        ("city", "Austin"),
        ("province", "TX"),
        ("zip", "1"),
    ]
    assert aligned["b"] == users["b"]
    assert aligned["c"] == users["c"]
    assert users == original  # input untouched


def _fake_workload(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "users.json").write_text("{}")
    return folder


def test_find_data_dir_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    explicit = _fake_workload(tmp_path / "explicit")
    env = _fake_workload(tmp_path / "env")
    shared = _fake_workload(tmp_path / "root" / "shared" / "workloads" / "airline")
    deep = tmp_path / "root" / "repo" / "sub"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    monkeypatch.setenv(data_mod.DATA_ENV_VAR, str(env))
    assert find_data_dir(explicit) == explicit
    assert find_data_dir() == env
    monkeypatch.delenv(data_mod.DATA_ENV_VAR)
    assert find_data_dir().resolve() == shared.resolve()
    with pytest.raises(AirlineDataNotFound) as info:
        find_data_dir(tmp_path / "nothing")
    assert info.value.searched == (tmp_path / "nothing",)
    monkeypatch.setenv(data_mod.DATA_ENV_VAR, str(tmp_path / "nothing"))
    with pytest.raises(AirlineDataNotFound):
        find_data_dir()
