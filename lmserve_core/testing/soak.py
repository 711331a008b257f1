"""A sustained multi-user workload against a running server or cluster, with a fault midway.

Each client holds a conversation of its own (a system prompt of its own, then turn after
turn) and streams every reply; about a third of the replies it cuts after a few chunks, as
a user who stops reading. A refusal (429, 503) is retried after its ``retry-after``. Halfway
through, ``fault()`` runs (e.g. kill a replica). Every request is recorded: which replica
served it (``x-lmserve-replica``), how it ended, and what its prompt found cached.

How a request ends:

- ``done``: the stream ended with ``[DONE]`` and no error;
- ``cut``: the client left, on purpose;
- ``full``: the conversation outgrew the context (400 ``context_length_exceeded``): the
  client starts it over;
- ``lost``: the stream ended with the dialect's in-band error, or the request failed (only
  requests on the faulted replica may);
- ``hung``: nothing arrived for ``stall`` seconds.

:func:`check` says what the report breaks: a hung stream, a request lost that was not in
flight on the faulted replica, a conversation of that replica never served again.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPLICA_HEADER = "x-lmserve-replica"
FULL = "context_length_exceeded"


@dataclass
class Turn:
    conversation: int
    started: float
    ended: float = 0.0
    outcome: str = ""
    replica: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    refusals: int = 0


@dataclass
class SoakReport:
    turns: list[Turn] = field(default_factory=list)
    fault_at: float | None = None
    faulted: str | None = None  # the replica fault() named
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # fds, MiB

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.turns)


def system_prompt(i: int) -> str:
    notes = " ".join(f"Fact {j}: box {i * 17 + j} holds {(i + j) % 9} keys." for j in range(10))
    return f"You are assistant {i}. Keep answers short. {notes}"


async def _turn(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                messages: list[dict[str, str]], turn: Turn, cut: bool, stall: float,
                max_tokens: int) -> str:
    """One streamed turn; its reply text ('' when cut or lost). Retries refusals."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.7,
            "stream": True, "stream_options": {"include_usage": True}}
    while True:
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                     headers=headers, timeout=httpx.Timeout(stall)) as reply:
                turn.replica = reply.headers.get(REPLICA_HEADER)
                if reply.status_code in (429, 503):
                    turn.refusals += 1
                    await reply.aread()
                    await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
                    continue
                if reply.status_code != 200:
                    full = reply.status_code == 400 and FULL.encode() in await reply.aread()
                    turn.outcome = "full" if full else "lost"
                    return ""
                text, chunks, done = "", 0, False
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        turn.outcome = "lost"
                        return ""
                    usage = chunk.get("usage")
                    if usage:
                        turn.prompt_tokens = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        turn.cached_tokens = int(details.get("cached_tokens") or 0)
                    for choice in chunk.get("choices") or []:
                        text += (choice.get("delta") or {}).get("content") or ""
                    chunks += 1
                    if cut and chunks == 3:
                        turn.outcome = "cut"
                        return ""
                turn.outcome = "done" if done else "lost"
                return text if done else ""
        except httpx.TimeoutException:
            turn.outcome = "hung"
            return ""
        except httpx.HTTPError:
            turn.outcome = "lost"
            return ""
        finally:
            turn.ended = time.monotonic()


async def _client(i: int, url: str, headers: dict[str, str], until: float, stall: float,
                  report: SoakReport, rng: random.Random) -> None:
    messages = [{"role": "system", "content": system_prompt(i)}]
    async with httpx.AsyncClient() as client:
        n = 0
        while time.monotonic() < until:
            n += 1
            question = {"role": "user", "content": f"Question {n}: which box holds most keys?"}
            turn = Turn(i, time.monotonic())
            report.turns.append(turn)
            text = await _turn(client, url, headers, [*messages, question], turn,
                               cut=rng.random() < 1 / 3, stall=stall,
                               max_tokens=rng.randint(16, 48))
            if text:  # the conversation goes on from a reply read whole
                messages += [question, {"role": "assistant", "content": text}]
            elif turn.outcome == "full":
                messages = messages[:1]
            await asyncio.sleep(rng.uniform(0.0, 0.3))


def cluster_replicas(url: str, *, want: int = 2, timeout: float = 30,
                     headers: dict[str, str] | None = None) -> dict[str, int]:
    """Replica name -> pid of ``lmserve cluster``'s replicas answering at ``url`` (requests
    without a body are routed round robin, so a few requests reach every one)."""
    found: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(found) < want:
        try:
            r = httpx.get(url + "/cluster/replica", headers=headers, timeout=10)
            if r.status_code == 200:
                found[r.json()["replica"]] = r.json()["pid"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return found


def cluster_ingress_pid() -> int | None:
    """The process of ``lmserve cluster``'s ingress on this machine (Ray names its worker
    after the deployment), or None."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"lmserve-ingress" in cmdline.read_bytes():
                return int(cmdline.parent.name)
        except OSError:
            continue
    return None


def process_figures(pid: int) -> tuple[int, float]:
    """Open file descriptors and resident MiB of a process."""
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return fds, int(line.split()[1]) / 1024
    return fds, 0.0


async def soak(url: str, *, seconds: float, clients: int, fault: Callable[[], str | None] | None,
               watch: Callable[[], dict[str, int]] | None = None, api_key: str | None = None,
               stall: float = 60.0, seed: int = 0) -> SoakReport:
    """Run the workload for ``seconds``; ``fault()`` halfway (it returns the replica it
    faulted). ``watch()`` names the processes whose descriptors and memory are sampled
    (name: pid), at a quarter of the run and at its end."""
    report = SoakReport()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    until = time.monotonic() + seconds
    rng = random.Random(seed)
    tasks = [asyncio.create_task(_client(i, url, headers, until, stall, report,
                                         random.Random(rng.random()))) for i in range(clients)]

    def sample() -> None:
        for name, pid in (watch() if watch else {}).items():
            report.samples.setdefault(name, []).append(process_figures(pid))

    await asyncio.sleep(seconds / 4)
    await asyncio.to_thread(sample)
    await asyncio.sleep(seconds / 4)
    if fault is not None:
        report.fault_at = time.monotonic()
        report.faulted = await asyncio.to_thread(fault)
    await asyncio.gather(*tasks)
    await asyncio.to_thread(sample)
    return report


def check(report: SoakReport, *, fds_slack: int = 16,
          mib_slack: Mapping[str, float] | None = None) -> list[str]:
    """What the report breaks (an empty list: nothing). A watched process may grow by
    ``fds_slack`` descriptors and by its ``mib_slack`` MiB (default 64: a server's KV slots
    commit their pages as conversations fill them, so give a replica their size)."""
    problems = [f"conversation {t.conversation}: a stream hung" for t in report.turns
                if t.outcome == "hung"]
    at = report.fault_at
    for t in report.turns:
        if t.outcome != "lost":
            continue
        in_flight = at is not None and t.started <= at <= t.ended
        if not (t.replica == report.faulted or (t.replica is None and in_flight)):
            problems.append(f"conversation {t.conversation}: a request lost on {t.replica}, "
                            f"not the faulted replica")
    if at is not None:
        owned = {t.conversation for t in report.turns
                 if t.replica == report.faulted and t.started <= at}
        for c in owned:
            after = [t for t in report.turns if t.conversation == c and t.started > at]
            if after and not any(t.outcome in ("done", "cut") for t in after):
                problems.append(f"conversation {c} of the faulted replica was not served again")
    for name, figures in report.samples.items():
        if len(figures) == 2:
            (fds0, mib0), (fds1, mib1) = figures
            if fds1 - fds0 > fds_slack or mib1 - mib0 > (mib_slack or {}).get(name, 64.0):
                problems.append(f"{name}: {fds0} -> {fds1} descriptors, "
                                f"{mib0:.0f} -> {mib1:.0f} MiB")
    return problems


def summary(report: SoakReport) -> dict[str, Any]:
    """Counts and figures for a benchmark's record."""
    at = report.fault_at
    moved = sorted({t.conversation for t in report.turns
                    if t.replica == report.faulted and at is not None and t.started <= at})
    later_shares = []
    for c in moved:  # after the fault: the first turn read cold, the next ones cached
        after = [t for t in report.turns if t.conversation == c and at is not None
                 and t.started > at and t.outcome == "done" and t.prompt_tokens]
        later_shares += [t.cached_tokens / t.prompt_tokens for t in after[1:]]
    return {
        "requests": len(report.turns),
        **{o: report.count(o) for o in ("done", "cut", "full", "lost", "hung")},
        "refusals": sum(t.refusals for t in report.turns),
        "faulted_conversations": len(moved),
        "their_later_cached_share": (sum(later_shares) / len(later_shares)
                                     if later_shares else None),
        "processes": {k: [list(x) for x in v] for k, v in report.samples.items()},
    }
