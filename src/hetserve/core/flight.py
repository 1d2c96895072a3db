"""Single-flight coordination of identical prompts.

A request whose prompt equals that of a request already in flight (waiting or
prefilling) waits as a follower instead of computing the same prompt again. The
leader's prompt pages are then restored from the prefix cache by each follower,
which generates its own output with its own sampling parameters.

States of a tracked request: LEADER (runs), FOLLOWER (held back), RELEASED
(runs; tracked until it ends). A flight is OPEN while its leader has not
finished its prefill; only an open flight takes followers. Followers are
released when the leader's prompt pages are published (`after-prefill`) or
when the leader finishes (`at-completion`). If the leader ends without
releasing them (abort, failure), the first follower becomes the leader.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MODES = ("off", "at-completion", "after-prefill")


class Role(enum.Enum):
    LEADER = "leader"
    FOLLOWER = "follower"
    RELEASED = "released"


@dataclass
class Flight:
    key: tuple
    leader: str
    followers: list[str] = field(default_factory=list)
    open: bool = True


class FlightCoordinator:
    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"unknown single-flight mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self._open: dict[tuple, Flight] = {}  # key -> the open flight for it
        self._flight_of: dict[str, Flight] = {}  # leader and follower ids -> their flight
        self._role: dict[str, Role] = {}

    def role(self, request_id: str) -> Role | None:
        return self._role.get(request_id)

    def add(self, request_id: str, key: tuple) -> bool:
        """Track a new request; True if it should run now, False if it is held as a follower."""
        if self.mode == "off":
            return True
        flight = self._open.get(key)
        if flight is not None:
            flight.followers.append(request_id)
            self._flight_of[request_id] = flight
            self._role[request_id] = Role.FOLLOWER
            return False
        flight = Flight(key, request_id)
        self._open[key] = flight
        self._flight_of[request_id] = flight
        self._role[request_id] = Role.LEADER
        return True

    def prefill_done(self, request_id: str, release: bool = True) -> list[str]:
        """The leader's prompt is computed: close its flight to newcomers. Returns the followers
        to release now (after-prefill, when release says its prompt pages are published)."""
        flight = self._flight_of.get(request_id)
        if flight is None or self._role.get(request_id) is not Role.LEADER or not flight.open:
            return []
        flight.open = False
        self._open.pop(flight.key, None)
        return self._release(flight) if self.mode == "after-prefill" and release else []

    def end(self, request_id: str, completed: bool) -> list[str]:
        """A tracked request ended (completed, or aborted/failed). Returns requests to run now:
        released followers, or a promoted new leader."""
        if self.mode == "off":
            return []
        role = self._role.pop(request_id, None)
        if role is None:
            raise KeyError(f"single-flight: end of request {request_id!r}, which it never tracked")
        flight = self._flight_of.pop(request_id, None)
        if role is Role.RELEASED or flight is None:
            return []
        if role is Role.FOLLOWER:
            flight.followers.remove(request_id)
            return []
        # The leader ended.
        if not flight.followers:
            self._close(flight)
            return []
        if completed:
            self._close(flight)
            return self._release(flight)
        # Aborted or failed: the first follower takes over, the others follow it.
        new_leader = flight.followers.pop(0)
        flight.leader = new_leader
        self._role[new_leader] = Role.LEADER
        if not flight.open:  # its prompt pages may already be published: no reason to hold the rest
            return [new_leader] + self._release(flight)
        return [new_leader]

    def _release(self, flight: Flight) -> list[str]:
        released, flight.followers = flight.followers, []
        for rid in released:
            self._role[rid] = Role.RELEASED
            self._flight_of.pop(rid, None)
        return released

    def _close(self, flight: Flight) -> None:
        flight.open = False
        if self._open.get(flight.key) is flight:
            del self._open[flight.key]

    @property
    def num_tracked(self) -> int:
        return len(self._role)
