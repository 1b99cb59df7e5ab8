"""First-come-first-served admission of requests into KV-cache slots."""

from __future__ import annotations

from collections import deque

from specula.runtime.engine.request import Request


class Scheduler:
    """Keeps the waiting queue and the running batch (at most ``max_num_seqs``)."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._by_id: dict[str, Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._by_id[request.request_id] = request

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots, oldest first; returns those admitted."""
        admitted = []
        while self.waiting and self._free_slots:
            request = self.waiting.popleft()
            request.slot = self._free_slots.pop()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def remove(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its slot; ``None`` if unknown."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        if request.slot >= 0:
            self.running.remove(request)
            self._free_slots.append(request.slot)
            request.slot = -1
        else:
            self.waiting.remove(request)
        return request

    def remove_finished(self) -> None:
        for request in [r for r in self.running if r.finished]:
            self.remove(request.request_id)
