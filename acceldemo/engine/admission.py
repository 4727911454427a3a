"""The engine's line: every front end's requests get a ticket, devices are handed out in turn across clients (each
client's tickets in arrival order), and past the operator's limits — the line's, and each client's share of it — a
request that would have to wait is refused at once. A freed device goes with the waiting tickets that can share its
call (`Sharing`)."""
from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import Cancelled, ClientQueueFull, DeviceBusy, QueueFull
from ..records import DeviceSet, Phase, Progress, ProgressCallback

# How often a waiting request looks at its stop flag and tells its place in line when that changed.
POLL_S = 0.2


@dataclass(frozen=True)
class Sharing:
    """Which tickets may be drawn in one pipeline call with this one: those with the same `key`. `take(devices, n)`:
    how many of `n` such tickets (this one included) one call on `devices` takes, at least 1."""

    key: Hashable
    take: Callable[[DeviceSet, int], int]

    def cap(self, devices: DeviceSet) -> int:
        return self.take(devices, sys.maxsize)


@dataclass(eq=False)
class Ticket:
    """One request's place in line: the device sets it can run on, and the one it got. A ticket given its devices
    together with others leads their shared call (`riders`), or rides in another's (`leader`); a rider's result
    comes through its `outcome`."""

    number: int
    what: str  # e.g. "generate 64x64 on tiny-shapes", shown in the line and on the devices
    candidates: tuple[DeviceSet, ...]
    # Among free device sets, the one where this request is best served (highest first): e.g. where its pipeline
    # is already resident with its shape compiled. Asked when devices are handed out.
    preference: Callable[[DeviceSet], int]
    entered: float = field(default_factory=time.monotonic)
    granted: DeviceSet | None = None
    started: float | None = None
    sharing: Sharing | None = None
    payload: object = None  # what its owner needs to run it in a shared call (the engine's `Member`)
    # Who sent it (a key's name, an API user, a page session or a peer address; "" for the engine's own tickets:
    # warm-ups, restarts): the line takes turns across clients.
    client: str = ""
    # Its turn: the line's turn when it entered, or one past its client's previous ticket's, whichever is later.
    turn: int = 0
    # What it waits for, as a person reads it ("" : its device sets, e.g. `cpu:0 or cpu:1`).
    place_name: str = ""
    leader: Ticket | None = None
    riders: list[Ticket] = field(default_factory=list)
    outcome: Future = field(default_factory=Future)

    @property
    def devices(self) -> set[tuple[str, int]]:
        return {(c.hardware, i) for c in self.candidates for i in c.indices}

    def deliver(self, outcome: object) -> None:
        """A rider's result from the call it was drawn in: its own image's, or the exception it ends with."""
        if isinstance(outcome, BaseException):
            self.outcome.set_exception(outcome)
        else:
            self.outcome.set_result(outcome)

    def where(self) -> str:
        if self.place_name:
            return self.place_name
        if len(self.candidates) <= 3:
            return " or ".join(map(str, self.candidates))
        return f"{self.candidates[0].hardware} (any of {len(self.candidates)} device sets)"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Line:
    """Tickets waiting for devices, and the tickets running on them.

    Waiting tickets take turns by client (start-time fair queueing): a ticket's turn is the line's current turn
    when it enters, or one past its client's previous ticket's if that is later, and tickets get devices by turn,
    then by arrival — so one client's burst does not push back a client who sends one request, and a client who
    was away gets no credit for it. A freed device goes to the first waiting
    ticket in that order that can use it: a later ticket never takes a device an earlier one is waiting for, so a
    request for two devices is not starved by requests for one. A ticket that finds a free device set does not wait
    at all, however long the line for other devices is.

    `limit` caps the waiting tickets of all clients, `client_limit` those of one client (None: no cap of its own).
    """

    def __init__(self, limit: int, wait_s: float, client_limit: int | None = None):
        self.limit, self.wait_s, self.client_limit = limit, wait_s, client_limit
        self._turn = 0  # the turn of the last ticket given devices
        self._last_turn: dict[str, int] = {}  # each client's latest ticket's turn (those behind the line's: dropped)
        self._changed = threading.Condition()
        self._waiting: list[Ticket] = []
        self._running: dict[tuple[str, int], Ticket] = {}
        self._numbers = itertools.count(1)

    def enter(self, what: str, candidates: Sequence[DeviceSet],
              preference: Callable[[DeviceSet], int] = lambda devices: 0, admitted: bool = False,
              client: str = "") -> Ticket:
        """A ticket in line, granted at once if a device set is free; QueueFull if it would wait past the limit.

        `admitted`: the request holds a place already (a retry after its replica was lost, a replica's restart, the
        next replica of a warm-up): it enters whatever the line's length.
        """
        return self.enter_together(what, candidates, 1, preference, admitted, client=client)[0]

    def reenter(self, ticket: Ticket, candidates: Sequence[DeviceSet]) -> Ticket:
        """A new ticket for an admitted request whose replica was lost: the same request, at the end of the line."""
        return self.enter_together(ticket.what, candidates, 1, ticket.preference, True, ticket.sharing,
                                   [ticket.payload], ticket.client, ticket.place_name)[0]

    def enter_together(self, what: str, candidates: Sequence[DeviceSet], count: int,
                       preference: Callable[[DeviceSet], int] = lambda devices: 0,
                       admitted: bool = False, sharing: Sharing | None = None,
                       payloads: Sequence[object] | None = None, client: str = "",
                       place_name: str = "") -> list[Ticket]:
        """`count` tickets of one request (its images), admitted all or none: ClientQueueFull if those that would
        wait push its client's waiting tickets past `client_limit`, else QueueFull if they push the line past its
        limit — and nothing held. With `sharing`, each may be drawn in one call with others."""
        tickets = [Ticket(next(self._numbers), what, tuple(candidates), preference, sharing=sharing,
                          payload=payloads[i] if payloads else None, client=client, place_name=place_name)
                   for i in range(count)]
        with self._changed:
            before = self._last_turn.get(client)
            for ticket in tickets:
                ticket.turn = self._next_turn(client)
            self._waiting.extend(tickets)
            self._hand_out()
            if not admitted and any(t.granted is None for t in tickets):
                own = sum(1 for t in self._waiting if t.client == client) if client else 0
                if self.client_limit is not None and self.client_limit < self.limit and own > self.client_limit:
                    self._withdraw(tickets, client, before)
                    self._hand_out()
                    raise ClientQueueFull(own - count + sum(1 for t in tickets if t.granted is not None),
                                          self.client_limit, self._ahead(tickets[0].devices))
                if len(self._waiting) > self.limit:
                    self._withdraw(tickets, client, before)
                    self._hand_out()
                    raise QueueFull(len(self._waiting), self.limit, self._ahead(tickets[0].devices))
        return tickets

    def _next_turn(self, client: str) -> int:
        if not client:  # the engine's own tickets: the line's current turn
            return self._turn
        turn = max(self._turn, self._last_turn.get(client, self._turn - 1) + 1)
        self._last_turn[client] = turn
        if len(self._last_turn) > 1024:  # clients whose turns are all behind the line's would start at its turn anyway
            self._last_turn = {c: t for c, t in self._last_turn.items() if t >= self._turn}
        return turn

    def _withdraw(self, tickets: list[Ticket], client: str = "", last_turn: int | None = None) -> None:
        """Take a refused request's tickets out, whatever they got (its client's turns as before it came); tickets of
        others that were to ride in their call wait again in their places."""
        if client and last_turn is None:
            self._last_turn.pop(client, None)
        elif client:
            self._last_turn[client] = last_turn
        for ticket in tickets:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            if ticket.leader is not None and ticket.leader not in tickets:
                ticket.leader.riders.remove(ticket)
            self._free(ticket)
            for rider in ticket.riders:
                if rider not in tickets:
                    rider.granted = rider.started = rider.leader = None
                    self._waiting.append(rider)
            ticket.riders.clear()
        self._waiting.sort(key=lambda t: t.number)

    def gather(self, leader: Ticket, until: float) -> None:
        """Hold the leader's call open until `until` (monotonic seconds) for waiting tickets that can share it, or
        until it is full."""
        with self._changed:
            while leader.sharing is not None and leader.granted is not None:
                self._gather(leader)
                left = until - time.monotonic()
                if left <= 0 or 1 + len(leader.riders) >= leader.sharing.cap(leader.granted):
                    return
                self._changed.wait(left)

    def wait(self, ticket: Ticket, on_progress: ProgressCallback = lambda event: None,
             cancelled: Callable[[], bool] = lambda: False) -> DeviceSet:
        """The device set the ticket was given, once it has one; telling its place in line meanwhile."""
        deadline = ticket.entered + self.wait_s
        told = None
        while True:
            with self._changed:
                if ticket.granted is None and not cancelled() and time.monotonic() < deadline:
                    self._changed.wait(POLL_S)
                granted, place = ticket.granted, self._place(ticket)
                if granted is None and (cancelled() or time.monotonic() >= deadline):
                    self._waiting.remove(ticket)
                    self._hand_out()
                    if cancelled():
                        raise Cancelled(f"stopped while {ordinal(place)} in line for {ticket.where()}; "
                                        "nothing was started")
                    raise DeviceBusy(f"{ticket.where()} stayed busy for {self.wait_s:.0f} s "
                                     "(ACCELDEMO_DEVICE_WAIT_S); retry in a moment")
            if granted is not None:
                return granted
            if place != told:
                told = place
                on_progress(Progress(Phase.QUEUE, f"{ordinal(place)} in line for {ticket.where()}", place))

    def release(self, ticket: Ticket) -> None:
        """The ticket is done with: its devices are free again (whether its job succeeded or not), or it leaves the
        line if it never got any."""
        with self._changed:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            self._free(ticket)
            self._hand_out()

    def _free(self, ticket: Ticket) -> None:
        for device in [d for d, holder in self._running.items() if holder is ticket]:
            del self._running[device]

    def waiting(self) -> list[Ticket]:
        with self._changed:
            return list(self._waiting)

    def running(self) -> dict[tuple[str, int], Ticket]:
        """Each busy device (hardware, index) and the ticket running on it."""
        with self._changed:
            return dict(self._running)

    def place(self, ticket: Ticket) -> int:
        with self._changed:
            return self._place(ticket)

    def _place(self, ticket: Ticket) -> int:
        """1 + the waiting tickets ahead of this one (in turn order) that want any of its devices (0 once it runs)."""
        if ticket.granted is not None or ticket not in self._waiting:
            return 0
        order = self._in_turn()
        return 1 + self._ahead(ticket.devices, order[:order.index(ticket)])

    def _in_turn(self) -> list[Ticket]:
        """The waiting tickets in the order they get devices: by turn, then by arrival."""
        return sorted(self._waiting, key=lambda ticket: (ticket.turn, ticket.number))

    def _ahead(self, devices: set[tuple[str, int]], tickets: list[Ticket] | None = None) -> int:
        """Waiting tickets (of `tickets`, by default all) that want any of these devices."""
        return sum(1 for other in (self._waiting if tickets is None else tickets) if other.devices & devices)

    def _hand_out(self) -> None:
        """Give free device sets to waiting tickets in arrival order, then let the tickets still waiting join the
        calls they can share (call with the condition held): free devices first, so a request that could run on a
        device of its own is not drawn in another's call."""
        claimed: set[tuple[str, int]] = set()  # devices an earlier waiting ticket is owed
        granted = []
        for ticket in self._in_turn():
            free = [c for c in ticket.candidates
                    if not any((c.hardware, i) in self._running or (c.hardware, i) in claimed for i in c.indices)]
            if not free:
                claimed |= ticket.devices
                continue
            chosen = max(free, key=ticket.preference)
            ticket.granted, ticket.started = chosen, time.monotonic()
            self._turn = max(self._turn, ticket.turn)
            for i in chosen.indices:
                self._running[(chosen.hardware, i)] = ticket
            self._waiting.remove(ticket)
            granted.append(ticket)
        for leader in granted:
            self._gather(leader)
        self._changed.notify_all()

    def _gather(self, leader: Ticket) -> None:
        """Waiting tickets that can share the leader's call join it, in arrival order, as many as one call takes."""
        if leader.sharing is None or leader.granted is None:
            return
        devices = leader.granted
        fits = [t for t in self._in_turn() if t.sharing is not None and t.sharing.key == leader.sharing.key
                and devices in t.candidates]
        if not fits:
            return
        size = 1 + len(leader.riders)
        for rider in fits[:max(leader.sharing.take(devices, size + len(fits)) - size, 0)]:
            self._waiting.remove(rider)
            rider.granted, rider.started, rider.leader = devices, time.monotonic(), leader
            self._turn = max(self._turn, rider.turn)
            leader.riders.append(rider)
