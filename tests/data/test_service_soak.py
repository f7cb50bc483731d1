"""Soak: a served trajectory service (real rpc Server and Clients on loopback) under a seeded random mix of
worker deaths, hung workers (lease expiry), lost consume replies, duplicated requests and malformed samples
(token ids the model cannot embed among them).

Throughout: every group is in exactly one state (accounted once), every group the service counts as
consumed reached the trainer exactly once with the samples its worker sent, the staleness bound holds,
and no group stays with a dead or hung worker longer than the lease. Leases run on a fake clock that the
test advances, so expiry is deterministic; RPC timeouts are real (the lost replies).
"""

import math
import random
import socket

import pytest
from service_placements import SERVICE_METHODS
from waiting import wait_until

from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import SampleRefused, TrajectoryService
from jaxflow.transport import rpc, wire

pytestmark = pytest.mark.slow  # a long randomised run against a served service

ETA, BATCH, N, LEASE, VOCAB = 2, 3, 2, 0.2, 1000


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def tokens_of(gid, version, k=2):
    return Sample([gid % 997] * k, [-0.25] * k, [version] * k, None)


class Soak:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.clock = Clock()
        records = [{"prompt": [1 + i % 40, 2], "meta": {"i": i}} for i in range(100_000)]
        self.service = TrajectoryService(PromptSource(records, shuffle=False, num_epochs=1), batch_groups=BATCH,
                                         group_size=N, eta=ETA, lease_s=LEASE, clock=self.clock, max_attempts=50,
                                         vocab_size=VOCAB)
        self.server = rpc.Server(self.service, SERVICE_METHODS["TrajectoryService"], token="t").start()
        self.client = rpc.Client(self.server.address, token="t")
        self.v = 0  # the trainer's version
        self.workers = {w: {"version": 0, "held": {}, "alive": True, "dead_at": None} for w in "abcde"}
        self.sent: dict[int, list[Sample]] = {}  # group -> the samples its worker finished it with
        self.received: dict[int, int] = {}  # group -> step it was trained at
        self.ops = {k: 0 for k in ("dispatch", "finish", "dup", "bad", "abort", "die", "hang", "wake",
                                   "consume", "lost_reply", "tick", "late_refused")}

    def close(self):
        self.client.close()
        self.server.close()

    # ---- workers ----
    def dispatch(self, w):
        st = self.workers[w]
        if self.client.needs_sync(st["version"]):
            st["version"] = self.v  # the trainer published v
        tasks = self.client.dispatch(w, st["version"], self.rng.randint(1, 3))
        if self.rng.random() < 0.1:  # the reply was "lost": the worker asks again; the first lot is orphaned
            self.ops["dup"] += 1
            tasks = self.client.dispatch(w, st["version"], 1)
        for t in tasks:
            st["held"][t.group_id] = t
        self.ops["dispatch"] += 1

    def _complete(self, w, t):
        ver = self.workers[w]["version"]
        out = []
        for i in range(t.n):
            prev = t.partial[i] if t.partial else Sample()
            new = tokens_of(t.group_id, ver)
            out.append(Sample(prev.tokens + new.tokens, prev.logprobs + new.logprobs,
                              prev.versions + new.versions, "stop"))
        return out

    def finish(self, w):
        st = self.workers[w]
        if not st["held"]:
            return
        gid = self.rng.choice(sorted(st["held"]))
        t = st["held"].pop(gid)
        samples = self._complete(w, t)
        if self.rng.random() < 0.15:  # a malformed sample or reward: refused, nothing changes but its count
            before = self.client.stats()
            bad = [Sample(list(s.tokens), list(s.logprobs), list(s.versions), s.finish_reason) for s in samples]
            kind = self.rng.randrange(5)
            rewards = [1.0, 0.0]
            if kind == 0:
                bad[0].logprobs[0] = math.nan
            elif kind == 1:
                bad[1].logprobs[-1] = "x"
            elif kind == 2:
                rewards = [math.inf, 0.0]
            elif kind == 3:
                bad[0].versions[0] = 10 ** 9
            else:
                bad[1].tokens[0] = VOCAB  # an id the model cannot embed
            with pytest.raises(SampleRefused, match=f"group {gid}") as refused:
                self.client.finish(gid, w, bad, rewards)
            before["counts"]["refused"] += 1
            before["counts"][f"refused_{refused.value.reason}"] += 1
            assert self.client.stats() == before
            self.ops["bad"] += 1
        self.client.finish(gid, w, samples, [float(gid % 2), 1.0])
        self.sent[gid] = samples
        self.ops["finish"] += 1
        if self.rng.random() < 0.1:  # a duplicated request: refused, counted once
            with pytest.raises(ValueError, match="not running|occupied|consumed|lease"):
                self.client.finish(gid, w, samples, [float(gid % 2), 1.0])
            self.ops["dup"] += 1

    def abort(self, w):
        st = self.workers[w]
        if st["held"]:
            gid = self.rng.choice(sorted(st["held"]))
            t = st["held"].pop(gid)
            partial = [Sample(s.tokens[:-1], s.logprobs[:-1], s.versions[:-1], None) for s in self._complete(w, t)]
            self.client.abort(gid, w, partial, "sync")
            self.ops["abort"] += 1

    def die(self, w, hang=False):
        st = self.workers[w]
        st["alive"], st["dead_at"] = False, self.clock.t
        if not hang:
            st["held"] = {}
        self.ops["hang" if hang else "die"] += 1

    def wake(self, w):
        st = self.workers[w]
        # A hung worker comes back and tries to hand in what it held: refused if its lease expired.
        for gid, t in sorted(st["held"].items()):
            try:
                self.client.finish(gid, w, self._complete(w, t), [1.0, 1.0])
                self.sent[gid] = self._complete(w, t)
            except ValueError as e:
                assert "lease" in str(e) and w in str(e), e
                self.ops["late_refused"] += 1
        st.update(alive=True, dead_at=None, held={})
        st["version"] = self.v
        self.ops["wake"] += 1

    # ---- trainer ----
    def consume(self):
        if self.client.buffer_state(self.v) == "pending":
            return
        if self.rng.random() < 0.3:  # the reply is lost (a client that gives up at once); retry
            # A trainer sends consume and its connection drops before the reply: the server consumes.
            with socket.create_connection(self.server.address, timeout=5) as sock:
                wire.send_message(sock, {"token": "t"})
                wire.recv_message(sock, 1 << 20)
                wire.send_message(sock, {"id": 1, "method": "consume", "args": [self.v], "kwargs": {"timeout": 1}})
            wait_until(lambda: self.client.progress()[0] != self.v, 10, "the server's consume", interval=0.001)
            assert self.client.progress()[0] == self.v + 1  # consumed on the server, reply lost
            self.ops["lost_reply"] += 1
        batch = self.client.consume(self.v, timeout=5)
        if self.rng.random() < 0.2:  # asked twice: the same batch
            assert self.client.consume(self.v, timeout=5).groups == batch.groups
        assert batch.step == self.v and batch.groups
        for g in batch.groups:
            assert g.group_id not in self.received, f"group {g.group_id} trained twice"
            assert self.v - g.v_start <= ETA, "staleness bound broken"
            assert g.samples == self.sent[g.group_id], f"group {g.group_id} is not what its worker sent"
            self.received[g.group_id] = self.v
        self.v += 1
        self.client.mark_published(self.v)
        self.ops["consume"] += 1

    # ---- invariants ----
    def check(self):
        stats = self.client.stats()  # applies the leases that are due
        counts, groups = stats["counts"], stats["groups"]
        assert counts["created"] == sum(groups.values())
        assert counts["consumed"] == len(self.received) == groups["consumed"]
        snap = self.client.snapshot()
        for g in snap["groups"]:
            if g["state"] == "running":
                st = self.workers[g["worker"]]
                # Nobody waits on a dead or hung worker's group for longer than the lease.
                assert st["alive"] or self.clock.t - st["dead_at"] <= LEASE, (g["group_id"], g["worker"])

    def step(self):
        self.clock.t += self.rng.uniform(0.0, 0.06)
        self.ops["tick"] += 1
        alive = [w for w, s in self.workers.items() if s["alive"]]
        for w in alive:  # live workers renew what they hold
            lost = self.client.renew(w, sorted(self.workers[w]["held"]))
            for gid in lost:
                self.workers[w]["held"].pop(gid, None)
        r = self.rng.random()
        w = self.rng.choice(alive) if alive else None
        dead = [x for x, s in self.workers.items() if not s["alive"]]
        if w is None or (dead and r < 0.06):
            self.wake(self.rng.choice(dead))
        elif r < 0.30:
            self.dispatch(w)
        elif r < 0.62:
            self.finish(w)
        elif r < 0.68:
            self.abort(w)
        elif r < 0.71 and len(alive) > 1:
            self.die(w)
        elif r < 0.74 and len(alive) > 1:
            self.die(w, hang=True)
        else:
            self.consume()
        self.check()


@pytest.mark.parametrize("seed", [0, 1])
def test_soak_served_service_under_faults(seed):
    soak = Soak(seed)
    try:
        ops = soak.ops
        while sum(ops.values()) - ops["tick"] < 2000:  # operations on the service, faults included
            soak.step()
            assert ops["tick"] < 20_000, ops
        # Every fault kind happened, and the run made progress through them.
        assert min(ops[k] for k in ("dup", "bad", "die", "hang", "wake", "lost_reply")) > 0, ops
        stats = soak.client.stats()
        assert stats["counts"]["expired"] > 0 and soak.v >= 40, (stats["counts"], ops)
        assert stats["counts"]["consumed"] == len(soak.received)
        print(f"soak seed {seed}: ops {ops}, trained to version {soak.v}, counts {stats['counts']}")
    finally:
        soak.close()
