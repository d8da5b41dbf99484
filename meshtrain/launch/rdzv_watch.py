"""What a `meshtrain run` agent of a multi-node job (``--nnodes`` above 1) says about its
rendezvous and its peers, around torchrun's c10d rendezvous (launch/torchrun.py installs it).

* **While it waits for nodes** it says so within seconds and then periodically: "waiting for 1
  of 2 nodes at 127.0.0.1:29555 (rendezvous id j1d), 30 s of 600 s", with the nodes that joined.
  (torch's join loop calls it every second or so: :meth:`AgentWatch._joining`.)
* **Agents that disagree**: before it joins, each agent writes its own ``--nnodes`` and
  ``--nproc-per-node`` into the rendezvous store (``meshtrain/<id>/view/<n>``) and compares them
  with every other agent's, while waiting and once the round is complete; a difference is an
  error naming both agents (:class:`AgentsDisagree`), on each of them.
* **A dead node** is found by its heartbeat, not by a collective timing out: once a round is
  complete, a thread of each agent adds 1 to its key in the store every ``keep_alive_interval``
  seconds (torch's rendezvous setting, 5 s) and reads the others'; a node whose count has not
  moved for ``keep_alive_interval x keep_alive_max_attempt`` seconds (15 s: when torch's own
  rendezvous drops a node too), a node that says its workers failed, or a store that stops
  answering, makes the agent say so and stop its own workers. torchrun then restarts them (with
  ``--max-restarts``, into a new round without that node) or the job fails with that line.
  An agent whose workers finished writes so, and is no longer watched.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from meshtrain.errors import ConfigError
from meshtrain.launch.waits import Progress, stderr_line

PREFIX = "meshtrain run: "


class AgentsDisagree(ConfigError):
    """Agents of one job were given different ``--nnodes`` or ``--nproc-per-node``."""


class AgentWatch:
    """One agent's rendezvous messages, agreement check and heartbeats (see the module)."""

    def __init__(self, *, endpoint: str, run_id: str, nnodes: tuple[int, int], nproc: int,
                 conf: dict[str, str], stop_workers: Callable[[], None],
                 say: Callable[[str], None] = stderr_line, max_restarts: int = 0):
        self.endpoint, self.run_id, self.nnodes, self.nproc = endpoint, run_id, nnodes, nproc
        self.join_timeout = float(conf.get("join_timeout", 600))
        self.interval = float(conf.get("keep_alive_interval", 5))
        self.dead_after = self.interval * int(conf.get("keep_alive_max_attempt", 3))
        self.stop_workers, self.say, self.max_restarts = stop_workers, say, max_restarts
        self.failure: str | None = None  # why this agent stopped its workers
        self.finished = False  # its workers finished (torchrun's exit barrier)
        self.last_seen, self.joined = "", 0  # the nodes that joined, as last seen while waiting
        self._published: set[int] = set()  # handlers (by id) whose view is in the store
        self._views: dict[int, dict] = {}  # the views read so far, by number
        self._progress: Progress | None = None
        self._beats: _Heartbeats | None = None
        self._exit_timer: threading.Timer | None = None

    def start_line(self) -> str:
        low, high = self.nnodes
        nodes = f"{high} nodes" if low == high else f"{low} to {high} nodes"
        return (f"{PREFIX}nodes meet at {self.endpoint} (rendezvous id {self.run_id}): waiting "
                f"up to {self.join_timeout:.0f} s for {nodes} (--rdzv-conf join_timeout); a "
                f"node whose agent sends no heartbeat for {self.dead_after:.0f} s is taken for "
                f"dead (keep_alive_interval {self.interval:g} s x keep_alive_max_attempt)")

    @contextlib.contextmanager
    def installed(self):
        """Around torchrun: its rendezvous handler and agent report through this watch."""
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler)

        watch = self
        next_rendezvous = DynamicRendezvousHandler.next_rendezvous
        exit_barrier = SimpleElasticAgent._exit_barrier

        def patched_next(handler):
            return watch._next_rendezvous(handler, next_rendezvous)

        def patched_exit_barrier(agent):
            watch.finished = True
            return exit_barrier(agent)

        DynamicRendezvousHandler.next_rendezvous = patched_next
        SimpleElasticAgent._exit_barrier = patched_exit_barrier
        try:
            yield self
        finally:
            DynamicRendezvousHandler.next_rendezvous = next_rendezvous
            SimpleElasticAgent._exit_barrier = exit_barrier

    # -- the rendezvous ---------------------------------------------------------------------
    def _next_rendezvous(self, handler, original):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousJoinOp

        self._stop_beats()
        self.failure = None  # (a new round: what stopped the last one is past)
        if self._exit_timer is not None:
            self._exit_timer.cancel()
        if id(handler) not in self._published:
            self._publish(handler)
            self._published.add(id(handler))
        self._check_views(handler)
        self._progress = Progress(self.say, self.join_timeout, prefix=PREFIX)
        executor = handler._op_executor
        run = executor.run

        def watched_run(state_handler, deadline, update_deadline=None):
            if isinstance(state_handler, _RendezvousJoinOp):
                join = state_handler

                def state_handler(ctx, deadline):
                    self._joining(handler, ctx)
                    return join(ctx, deadline)
            return run(state_handler, deadline, update_deadline)

        executor.run = watched_run
        try:
            info = original(handler)
        finally:
            del executor.run  # (the class's method again)
        self._check_views(handler)
        state = handler._state_holder.state
        nodes = {rank: (node.addr, node.pid) for node, rank in state.participants.items()}
        if len(nodes) > 1:
            host, port = self.endpoint.rsplit(":", 1)
            self._beats = _Heartbeats(self, host, int(port), state.round, info.rank, nodes)
            self._beats.start()
        return info

    def _view_key(self, n) -> str:
        return f"meshtrain/{self.run_id}/view/{n}"

    def _publish(self, handler) -> None:
        node = handler._this_node
        with contextlib.suppress(RuntimeError, ValueError, TimeoutError):  # (torch says it next)
            n = handler._store.add(f"meshtrain/{self.run_id}/views", 1)
            handler._store.set(self._view_key(n), json.dumps(
                {"nnodes": list(self.nnodes), "nproc": self.nproc, "addr": node.addr,
                 "pid": node.pid}))

    def _check_views(self, handler) -> None:
        """Raise AgentsDisagree when an agent's view differs from this one's. Store errors are
        left to torch's own next call (it names them)."""
        store = handler._store
        try:
            count = store.add(f"meshtrain/{self.run_id}/views", 0)
            for n in range(1, count + 1):
                if n not in self._views and store.check([self._view_key(n)]):
                    self._views[n] = json.loads(store.get(self._view_key(n)))
        except (RuntimeError, ValueError, TimeoutError):
            return
        me = handler._this_node
        for view in self._views.values():
            for what, mine, theirs, flag in (
                    ("--nnodes", list(self.nnodes), view["nnodes"], _nnodes),
                    ("--nproc-per-node", self.nproc, view["nproc"], str)):
                if mine != theirs:
                    raise AgentsDisagree(
                        f"the agents of rendezvous {self.run_id} at {self.endpoint} disagree on "
                        f"{what}: this one ({me.addr}, agent pid {me.pid}) has {flag(mine)}, "
                        f"the one at {view['addr']} (agent pid {view['pid']}) has "
                        f"{flag(theirs)}. Give every node the same {what}")

    def _joining(self, handler, ctx) -> None:
        """torch's join loop, before each of its steps: report the wait, compare the views."""
        state = ctx.state
        self._check_views(handler)
        joined = sorted(state.participants.items(), key=lambda item: item[1])
        if joined:  # (torch takes this node out again when it gives up)
            self.last_seen = ", ".join(f"{node.addr} (agent pid {node.pid})"
                                       for node, _ in joined[:6]) + \
                (", ..." if len(joined) > 6 else "")
            self.joined = len(joined)
        low, high = self.nnodes
        where = f"at {self.endpoint} (rendezvous id {self.run_id})"
        if state.complete and ctx.node not in state.participants:
            what = (f"the next round of the nodes {where}: the running one has "
                    f"{len(state.participants)} node(s), {self.last_seen}")
        elif low == high:
            what = f"{high - len(joined)} of {high} nodes {where}; joined: {self.last_seen}"
        else:
            what = (f"nodes {where}: {len(joined)} joined ({self.last_seen}), {low} to {high} "
                    "wanted")
        self._progress.tick(what)

    def timeout_line(self) -> str:
        low, high = self.nnodes
        return (f"{PREFIX}the rendezvous at {self.endpoint} (rendezvous id {self.run_id}) timed "
                f"out after {self.join_timeout:.0f} s (join_timeout) with {self.joined} of "
                f"{low if low == high else f'at least {low}'} nodes (joined: "
                f"{self.last_seen or 'none'}). Start every node's agent with the same "
                "--rdzv-endpoint, --rdzv-id and --nnodes, or wait longer with --rdzv-conf "
                "join_timeout=SECONDS")

    # -- heartbeats ---------------------------------------------------------------------------
    def _stop_beats(self) -> None:
        if self._beats is not None:
            self._beats.stop()
            self._beats = None

    def ended(self, ok: bool) -> None:
        """This agent is done (its workers finished, or failed for good): say so to the
        others, so that they do not take it for dead (or know it failed), and stop beating."""
        if self._beats is not None:
            self._beats.end("ok" if ok else "failed")
        self._stop_beats()

    def peer_lost(self, reason: str, store_lost: bool = False) -> None:
        """A heartbeat thread found ``reason``: say it; stop this node's workers (torchrun
        then restarts them or fails); without restarts, or without the store (no new round
        can meet), make sure this agent ends: torchrun's own calls to a frozen store never
        return."""
        if self.failure is not None:
            return
        if self.finished:
            self.say(f"{PREFIX}{reason} (this node's workers had finished)")
            return
        self.failure = reason
        self.say(f"{PREFIX}{reason}; stopping this node's workers")
        self.stop_workers()
        if self.max_restarts == 0 or store_lost:
            # torchrun's own store calls may wait their read_timeout (60 s) on a frozen store
            self._exit_timer = threading.Timer(max(5.0, self.dead_after), self._exit_now)
            self._exit_timer.daemon = True
            self._exit_timer.start()

    def close(self) -> None:
        """torchrun has returned: no more heartbeats, no forced exit."""
        self._stop_beats()
        if self._exit_timer is not None:
            self._exit_timer.cancel()

    def _exit_now(self) -> None:
        self.say(f"{PREFIX}the job failed: {self.failure}")
        os._exit(1)


def _nnodes(value) -> str:
    low, high = value
    return str(low) if low == high else f"{low}:{high}"


class _Heartbeats(threading.Thread):
    """One round's heartbeats: this agent's count up every ``interval`` s, the others' read."""

    def __init__(self, watch: AgentWatch, host: str, port: int, round_: int, rank: int,
                 nodes: dict[int, tuple[str, int]]):
        super().__init__(daemon=True, name="meshtrain-heartbeats")
        self.watch, self.host, self.port, self.rank, self.nodes = watch, host, port, rank, nodes
        self.prefix = f"meshtrain/{watch.run_id}/round{round_}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store = None

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _node(self, rank: int) -> str:
        addr, pid = self.nodes[rank]
        return f"node {rank} ({addr}, agent pid {pid})"

    def stop(self) -> None:
        self._stop.set()

    def _store_lost(self, how: str) -> None:
        if not (self._stop.is_set() or self.watch.finished):  # (finished: hosts may leave)
            self.watch.peer_lost(f"the rendezvous store at {self.watch.endpoint} {how}: the "
                                 "agent that hosts it has ended, or its node is gone or "
                                 "frozen", store_lost=True)

    def end(self, how: str) -> None:
        with self._lock, contextlib.suppress(Exception):
            if self._store is not None:
                self._store.set(self._key("end", self.rank), how)

    def run(self) -> None:
        import torch.distributed as dist

        watch = self.watch
        timeout = timedelta(seconds=max(5.0, watch.dead_after))
        try:
            with self._lock:
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=timeout, wait_for_workers=False)
        except Exception as error:  # noqa: BLE001 (any store error: it is gone)
            self._store_lost(f"does not answer ({_short(error)})")
            return
        others = [r for r in self.nodes if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}  # (count, when it last moved)
        last_loop = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_loop > watch.dead_after / 2:  # this process was not running: no
                seen = {r: (c, now) for r, (c, _) in seen.items()}  # evidence against others
            last_loop = now
            # a store whose process is frozen (or whose node vanished) never answers: the
            # client's timeout does not cover a read, so a timer does
            stuck = threading.Timer(watch.dead_after, self._store_lost, (
                f"did not answer for {watch.dead_after:.0f} s",))
            stuck.daemon = True
            stuck.start()
            try:
                with self._lock:
                    self._store.add(self._key("beat", self.rank), 1)
                    counts = {r: self._store.add(self._key("beat", r), 0) for r in seen}
                    ends = {r: self._store.get(self._key("end", r)).decode() for r in seen
                            if self._store.check([self._key("end", r)])}
            except Exception as error:  # noqa: BLE001
                self._store_lost(f"stopped answering ({_short(error)})")
                return
            finally:
                stuck.cancel()
            for r, how in ends.items():
                del seen[r]
                if how != "ok":
                    watch.peer_lost(f"{self._node(r)} ended: its workers failed (its output "
                                    "says why)")
                    return
            now = time.monotonic()
            for r, count in counts.items():
                if r not in seen:
                    continue
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] >= watch.dead_after:
                    watch.peer_lost(f"{self._node(r)} sent no heartbeat for "
                                    f"{now - seen[r][1]:.0f} s: it is taken for dead")
                    return
            self._stop.wait(watch.interval)


def _short(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else \
        type(error).__name__


def agent_watch(args, nproc: int, stop_workers: Callable[[], None]) -> AgentWatch | None:
    """The watch of an agent of a multi-node job (c10d rendezvous, ``--nnodes`` above 1);
    None otherwise."""
    from meshtrain.launch.rendezvous import max_nodes, rdzv_conf

    if args.rdzv_backend != "c10d" or max_nodes(args) == 1:
        return None
    from torch.distributed.run import parse_min_max_nnodes

    return AgentWatch(endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                      nnodes=parse_min_max_nnodes(args.nnodes), nproc=nproc,
                      conf=rdzv_conf(args.rdzv_conf), stop_workers=stop_workers,
                      max_restarts=args.max_restarts)


@contextlib.contextmanager
def watching(watch: AgentWatch | None):
    """torchrun runs inside: the watch installed; at the end the others are told how this
    agent ended. An agent that found the others disagree waits 2 s before it leaves, so that
    the store it may host lets them read why."""
    if watch is None:
        yield
        return
    try:
        with watch.installed():
            yield
    except AgentsDisagree:
        time.sleep(2)
        raise
    except BaseException:
        watch.ended(ok=False)
        raise
    else:
        watch.ended(ok=True)
    finally:
        watch.close()


def rendezvous_error_line(error: BaseException, watch: AgentWatch | None,
                          endpoint: str) -> str:
    """One line for an error of the rendezvous (torch's, which say little, or a wait's)."""
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                          RendezvousConnectionError,
                                                          RendezvousTimeoutError)

    if isinstance(error, RendezvousTimeoutError) and watch is not None:
        return watch.timeout_line()
    if isinstance(error, RendezvousClosedError):
        return (f"{PREFIX}the rendezvous at {endpoint} was closed by another node's agent (it "
                "failed or finished first: its output says why)")
    if isinstance(error, RendezvousConnectionError):
        cause = error.__cause__ or error
        return (f"{PREFIX}lost the rendezvous store at {endpoint} ({_short(cause)}): the agent "
                "that hosts it has ended or cannot be reached")
    return f"{PREFIX}{error}"
