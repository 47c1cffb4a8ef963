"""The elastic agent: one ``jaxdist launch --nnodes MIN:MAX`` per host, re-forming the job as hosts
fail, leave and arrive.

    jaxdist launch --nnodes 2:3 --rdzv-endpoint HOST:PORT --rdzv-id JOB -n K train.py ...

Each agent runs K processes of the job. The job runs in *rounds*: in round N the agents registered
in the rendezvous store (``jaxdist.launch.rendezvous``, served by the agent that can bind the endpoint)
are ordered (survivors keep their place, newcomers after them), ranks and the coordinator address
follow from that order, and every agent starts its K processes. A round ends when:

* a process fails or hangs, or an agent stops heartbeating (its host is lost): every agent kills
  its processes and registers for the next round; the job resumes from the newest step in memory
  (``jaxdist.memstate``), so at most one step is computed again;
* an agent is asked to leave (SIGTERM, a preemption notice) or a new agent registers: the agents
  agree on a stop step a little ahead of the current one (the first request wins in the store),
  every process stops exactly there (``BackupAndRestore`` saves a backup too) and the job
  re-forms without the leaver / with the newcomer, which receives the state from a live peer
  over the network: no step is lost;
* every process has finished: the job is done.

The first round closes when MAX agents have registered, or ``--rdzv-last-call`` seconds after
the first registration with at least MIN (torchrun's "last call"). If fewer than MIN agents are
alive for ``--rdzv-timeout`` seconds, the agents exit: 0 when the
last round ended cleanly (the state is in the persistent backup), 1 after a failure.

Losing the rendezvous host (the agent serving the store) does not end the job: once the store has
not answered for ``host_timeout_s``, the agents of the last round move it to the first live agent
in the round's order (``Agent._fail_over``), which serves a new store on its own address and the
rendezvous port; the round has failed, and the next resumes from memory. An agent that was in no
round yet has no one to move to and exits with status 1.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

from jaxdist.launch._procs import describe_exit, free_ports
from jaxdist.launch.cluster import ClusterSpec, split_address
from jaxdist.launch.hang import HangDetector
from jaxdist.launch.memstate import heartbeat_path, stop_path, write_stop
from jaxdist.launch.rendezvous import RendezvousClient, RendezvousError, probe, serve

HOST_TIMEOUT_S = 3.0      # an agent silent this long is lost
_BEAT_S = 0.3
_SETTLE_S = 0.5           # close a round this long after the last registration, all present
_DRAIN_LEAD_S = 1.0       # how far ahead (in time) the stop step is put


def _local_address(host: str, port: int) -> str:
    """This host's address as seen on the way to the rendezvous endpoint."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Agent:
    """One host's agent (used by ``jaxdist launch --nnodes``; ``launcher`` is its ``_Launcher``)."""

    def __init__(self, launcher: Any, *, nnodes: tuple[int, int], endpoint: str,
                 rdzv_id: str, nproc: int, max_restarts: int, rdzv_timeout_s: float,
                 host_timeout_s: float = HOST_TIMEOUT_S, last_call_s: float = 10.0):
        self.l = launcher
        self.min, self.max = nnodes
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.rdzv_timeout_s = rdzv_timeout_s
        self.host_timeout_s = host_timeout_s
        self.last_call_s = last_call_s
        self.hostname = socket.gethostname()
        self.id = f"{self.hostname}-{os.getpid()}-{secrets.token_hex(2)}"
        host, port = split_address(endpoint)
        self.server = serve(f"{host}:{port}", own_job=rdzv_id)
        self.rdzv_id, self._rdzv_port = rdzv_id, port
        self.store = RendezvousClient(endpoint, rdzv_id)
        self.addr = _local_address(host, port)
        self._round, self._members = -1, []  # the last round: number, [[agent id, info], ...]
        self._server_id: str | None = None  # the agent serving the store
        self._stopped = threading.Event()
        self._leaving = False
        self._quiet = False
        self._stop: int | None = None
        self._last_order: int | None = None

    def say(self, message: str) -> None:
        self.l.say(f"[agent {self.id}] {message}")

    def _alive_agents(self) -> dict[str, str]:
        """``{agent id: its host's name}`` of the agents not yet lost."""
        return {k: host for k, (host, age) in self.store.list("alive/").items()
                if age < self.host_timeout_s}

    # -- threads -------------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stopped.wait(_BEAT_S):
            if self._quiet:
                continue
            try:
                self.store.set(f"alive/{self.id}", self.hostname)
            except RendezvousError:
                pass  # the monitor notices a store that stays silent

    def _close_rounds(self) -> None:
        """On the store's host: closes each open round once enough agents have registered."""
        try:
            self._close_rounds_loop()
        except Exception as e:  # noqa: BLE001 - say why, or every agent waits in vain
            self.say(f"the rendezvous round closer failed: {type(e).__name__}: {e}")
            raise

    def _close_rounds_loop(self) -> None:
        while not self._stopped.wait(0.1):
            try:
                n = self.store.get("open")
                regs = self.store.list(f"r{n}/member/")
                alive = set(self._alive_agents())
                leaving = set(self.store.list("leaving/"))
            except RendezvousError:
                continue
            ready = {k: v for k, (v, _) in regs.items() if k in alive and k not in leaving}
            if len(ready) < self.min:
                continue
            newest = min(age for _, age in regs.values())
            oldest = max(age for _, age in regs.values())
            missing = alive - set(ready) - leaving
            # The first round also waits a little for agents still starting (torchrun's last call).
            if len(ready) >= self.max or (newest > _SETTLE_S and not missing
                                          and (n > 0 or oldest > self.last_call_s)):
                order = sorted(ready, key=lambda k: (ready[k]["order"], -regs[k][1]))[:self.max]
                self.store.set(f"r{n}/final", [[k, ready[k]] for k in order])
                self.store.set("open", n + 1)

    # -- rounds --------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs rounds until the job is done, this agent leaves, or too few agents remain."""
        if self.server is not None:
            self.say(f"serving the rendezvous store on {self.store.address}")
            self.store.set("server", self.id)
        else:
            try:  # a port held by another program, or another job's token: say so at once
                probe(self.store.address)
            except RendezvousError as e:
                self.say(str(e))
                return 2
        self.store.set_if_absent("open", 0, timeout_s=self.rdzv_timeout_s)
        self.store.set_if_absent("done", 0)  # so that the job's end never needs a new key
        threading.Thread(target=self._beat, daemon=True).start()
        if self.server is not None:
            threading.Thread(target=self._close_rounds, daemon=True).start()
        failures, clean = 0, True
        try:
            while True:
                try:
                    joined = self._join()
                    if joined is not None:
                        outcome, code = self._run_round(*joined)
                except RendezvousError as e:
                    if not self._fail_over(e):
                        raise
                    joined, outcome, code = (), "failed", 1  # the round's processes are gone
                if joined is None:
                    if self.l._signal is not None:
                        self.say(f"received {signal.Signals(self.l._signal).name} between "
                                 "rounds; leaving")
                        return 0 if clean else 128 + self.l._signal
                    if self.store.get("done"):
                        return 0
                    here = sorted(f"{host} (agent {k})" for k, host in self._alive_agents().items())
                    self.say(f"fewer than {self.min} agents registered within "
                             f"{self.rdzv_timeout_s:g} s ({len(here)} did: "
                             f"{', '.join(here) or 'none'}; {self.min - len(here)} more were "
                             "needed: start `jaxdist launch` with the same --rdzv-endpoint "
                             "and --rdzv-id on the missing hosts, or lower MIN in --nnodes); "
                             "exiting")
                    return 0 if clean else 1
                if outcome in ("done", "left", "signal"):
                    return code
                clean = outcome == "drained"
                if not clean:
                    failures += 1
                    if failures > self.max_restarts:
                        self.say(f"job failed after {failures - 1} restart(s) of this agent")
                        return code or 1
                    self.l.restarts += 1
        except RendezvousError as e:
            self.say(f"lost the rendezvous store ({e}); stopping this host's processes")
            return 1
        finally:
            self._stopped.set()
            try:
                self.store.delete(f"alive/{self.id}")
            except RendezvousError:
                pass
            if self.server is not None:
                self._drain_store()
                self.server[0].stop(0)

    def _drain_store(self) -> None:
        """Keeps the store up until the other agents have gone (or have been silent a while)."""
        end = time.monotonic() + self.rdzv_timeout_s
        while time.monotonic() < end:
            try:
                others = [k for k in self._alive_agents() if k != self.id]
            except RendezvousError:
                return
            if not others:
                return
            time.sleep(0.1)

    def _join(self) -> tuple[int, list] | None:
        deadline = time.monotonic() + self.rdzv_timeout_s
        port = free_ports(1, host="")[0]
        while time.monotonic() < deadline:
            if self.store.get("done") or self.l._signal is not None:
                return None
            n = self.store.get("open")
            order = self._last_order if self._last_order is not None else 1 << 30
            self.store.set(f"r{n}/member/{self.id}", {
                "addr": self.addr, "port": port, "nproc": self.nproc, "host": self.hostname,
                "order": order})
            while time.monotonic() < deadline and self.store.get("open") == n:
                time.sleep(0.05)
                if len(self._alive_agents()) >= self.min:  # a round runs or forms: enough hosts
                    deadline = time.monotonic() + self.rdzv_timeout_s
            final = self.store.get(f"r{n}/final")
            if final and any(k == self.id for k, _ in final):
                return n, final
        return None

    def _run_round(self, n: int, members: list) -> tuple[str, int]:
        self._round, self._members = n, members
        self._server_id = self.store.get("server")
        index = [k for k, _ in members].index(self.id)
        self._last_order = index
        first = sum(info["nproc"] for _, info in members[:index])
        world = sum(info["nproc"] for _, info in members)
        lead = members[0][1]
        coordinator = f"{lead['addr']}:{lead['port']}"
        ids = [k for k, _ in members]
        self.say(f"round {n}: {len(members)} host(s) {[m['host'] for _, m in members]}, "
                 f"ranks {first}..{first + self.nproc - 1} of {world}, coordinator "
                 f"{coordinator}")
        state_dir = self.l._state_dir
        for path in [stop_path(state_dir)] + [
                heartbeat_path(state_dir, r) for r in range(first, first + self.nproc)]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        procs, readers = [], []
        try:
            for i in range(self.nproc):
                env = self.l.child_env(ClusterSpec(coordinator, world, first + i).to_env(), n)
                procs.append(self.l.spawn(str(first + i), env, readers))
            return self._watch(n, ids, first, procs)
        finally:
            self.l._end_group(procs, readers)

    def _watch(self, n: int, ids: list[str], first: int, procs: list) -> tuple[str, int]:
        ranks = {first + i: p.pid for i, p in enumerate(procs)}
        detector = HangDetector(self.l._state_dir, ranks,
                                timeout_s=self.l._options.hang_timeout_s)
        draining = False
        store_ok = time.monotonic()

        def fail(reason: str, code: int = 1) -> tuple[str, int]:
            self.say(f"round {n} failed: {reason}; last completed step per local rank "
                     f"{detector.last_steps()}")
            self.store.set_if_absent(f"r{n}/failed", reason)  # a silent store: see _fail_over
            return "failed", code

        while True:
            time.sleep(0.1)
            codes = [p.poll() for p in procs]
            if self.l._signal is not None and not self._leaving:
                if self.l._signal == signal.SIGKILL:
                    return "signal", 128 + signal.SIGKILL
                self._leaving = True
                self.say(f"received {signal.Signals(self.l._signal).name}: this host leaves "
                         "the job at a step every process agrees on")
                self.store.set(f"leaving/{self.id}", 1)
            for i, code in enumerate(codes):
                if code not in (None, 0) and (not draining or None not in codes):
                    return fail(f"rank {first + i} on host {self.hostname} "
                                f"{describe_exit(code)}", code if code > 0 else 128 - code)
            if all(code == 0 for code in codes):
                if self._leaving:
                    self.say(f"left the job at step {self._stop if draining else 'end'}")
                    if self.server is not None:
                        self._serve_until_done()
                    return "left", 0
                if draining:
                    self.say(f"stopped at step {self._stop} to re-form the job")
                    return "drained", 0
                self.store.set("done", 1)
                return "done", 0
            hung = detector.check([first + i for i, c in enumerate(codes) if c is None])
            if hung and not draining:
                for h in hung:
                    self.say(h.describe(self.hostname, detector.timeout_s))
                return fail(f"rank(s) {[h.rank for h in hung]} on host {self.hostname} hung")
            try:
                failed = self.store.get(f"r{n}/failed")
                alive = {k: age for k, (_, age) in self.store.list("alive/").items()}
                leaving = set(self.store.list("leaving/"))
                joiners = [k for k in self.store.list(f"r{n + 1}/member/") if k not in ids]
                stop = self.store.get(f"r{n}/drain")
                done = self.store.get("done")
                store_ok = time.monotonic()
            except RendezvousError:
                if time.monotonic() - store_ok > self.host_timeout_s:
                    self.say(f"round {n} failed: the rendezvous store is silent; last completed "
                             f"step per local rank {detector.last_steps()}")
                    raise
                continue
            if done:
                continue  # another host's processes finished: ours are finishing too
            if failed:
                self.say(f"round {n} ended by a failure elsewhere: {failed}; last completed "
                         f"step per local rank {detector.last_steps()}")
                return "failed", 1
            lost = [k for k in ids if k != self.id and k not in leaving
                    and alive.get(k, math.inf) > self.host_timeout_s]
            if lost:
                return fail(f"host(s) {lost} lost (agent silent for more than "
                            f"{self.host_timeout_s:g} s)")
            if stop is None and (joiners or self._leaving or (leaving & set(ids))):
                steps = [s for s in detector.last_steps().values() if s is not None]
                if steps:  # a stop step needs a step to count from
                    step_s = detector.median_step_s() or 0.05
                    ahead = max(4, math.ceil(_DRAIN_LEAD_S / max(step_s, 1e-3)))
                    why = "a host joins" if joiners else "a host leaves"
                    stop = self.store.set_if_absent(f"r{n}/drain", max(steps) + ahead)
                    self.say(f"{why}: asking every process to stop at step {stop}")
            if stop is not None and not draining:
                draining, self._stop = True, stop
                write_stop(self.l._state_dir, stop)

    def _fail_over(self, error: RendezvousError) -> bool:
        """Moves the store to the next agent of the last round when its host is lost.

        Only a store silent for the host timeout is moved (an answer in that time keeps it: the
        round has failed and the job re-forms on it). Every agent of the last round then walks
        the round's order (the serving agent left out) and takes the first agent that can serve:
        that agent serves a new store on its own address and the rendezvous port, the others
        wait up to twice the host timeout for it to answer, then try the next. The round that
        was running has failed; the next one resumes from memory. Returns False when there is
        no one to move to (this agent served the store itself, was not in a round yet, or no
        candidate answered).
        """
        if self.server is not None or not self._members or self._server_id is None:
            return False
        old = self.store.address
        # One call past its deadline is not a lost host (a stall, a slow network): only a store
        # that stays silent for the host timeout is moved, or two stores could split the job.
        if self._answers(old, self.host_timeout_s):
            self.say(f"the rendezvous store answered again ({error}); the round is failed, the "
                     "job re-forms on the same store")
            return True
        for k, info in self._members:
            if k == self._server_id:
                continue
            address = f"{info['addr']}:{self._rdzv_port}"
            if k == self.id:
                self.server = serve(address, own_job=self.rdzv_id)
                if self.server is None:
                    self.say(f"cannot serve the rendezvous store on {address} (port taken)")
                    return False
                self._use_store(address)
                self.store.set("server", self.id)
                self.store.set("open", self._round + 1)
                self.store.set_if_absent("done", 0)
                threading.Thread(target=self._close_rounds, daemon=True).start()
                self.say(f"the rendezvous store on {old} is lost ({error}); this agent serves "
                         f"it now on {address} (new agents: --rdzv-endpoint {address})")
                return True
            if self._answers(address, 2 * self.host_timeout_s, server=k):
                self._use_store(address)
                self.say(f"the rendezvous store on {old} is lost ({error}); agent {k} serves it "
                         f"now on {address}")
                return True
        return False

    def _answers(self, address: str, within_s: float, server: str | None = None) -> bool:
        """Whether the store at ``address`` answers within ``within_s`` (served by ``server``,
        when given), asked with a short deadline every 0.1 s."""
        probe = RendezvousClient(address, self.rdzv_id, timeout_s=0.5)
        end = time.monotonic() + within_s
        try:
            while time.monotonic() < end:
                try:
                    found = probe.get("server")  # any answer, or the expected server's
                    if server is None or found == server:
                        return True
                except RendezvousError:
                    pass
                time.sleep(0.1)
            return False
        finally:
            probe.close()

    def _use_store(self, address: str) -> None:
        """Talks to the store at ``address`` from now on (the usual deadline); the old channel
        is closed, so a thread still using it gets a RendezvousError."""
        self.store.close()
        self.store = RendezvousClient(address, self.rdzv_id)

    def _serve_until_done(self) -> None:
        """A leaving agent that serves the store keeps serving it (without processes) until the
        job is done or no other agent is left, so that the others can re-form."""
        self.say("still serving the rendezvous store for the other hosts")
        self._quiet = True
        self.store.delete(f"alive/{self.id}")
        quiet_since = None
        while not self.store.get("done"):
            others = [k for k in self._alive_agents() if k != self.id]
            if others:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > self.rdzv_timeout_s:
                return
            time.sleep(0.2)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` or ``"N"`` as ``(min, max)``.

    >>> parse_nnodes("2:3"), parse_nnodes("2")
    ((2, 3), (2, 2))
    """
    lo, _, hi = text.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected MIN:MAX or N (integers)") from None
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return lo_n, hi_n
