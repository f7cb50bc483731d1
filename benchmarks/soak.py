"""Soak the trajectory service, served over loopback RPC, with a seeded random mix of the faults it must survive,
and check after every step that nothing is lost, trained twice or trained too stale.

The mix is seeded; the moments at which the threads (consume retries, episodes) land still vary from run to
run, so two runs of one seed differ in their counts, not in their verdict.

    .venv/bin/python benchmarks/soak.py [--quick] [--json PATH] [--seed N] [--ops N]

A `TrajectoryService` served by the real `jaxflow.transport.rpc` Server, called through Clients by five
workers and a trainer, on a fake lease clock (expiry is deterministic; RPC timeouts are real). Each step
the live workers renew their leases, then one operation happens:

  dispatch, finish, abort   the ordinary traffic; a dispatch reply is sometimes lost (asked again) and a
                            finish sometimes duplicated (refused)
  die, hang, wake           a worker dies (its groups come back when their leases run out) or hangs and
                            later hands in what it held (refused: its leases ran out)
  bad sample                a finish the service must refuse (`SampleRefused`, counted by reason): a token
                            id >= the vocab or >= 2**31, a sample over the row length, a non-finite reward,
                            a NaN log-prob, a version from the future
  episodes                  a group's samples come from episodes run through `EpisodeEngine` on environments:
                            normal, one that blocks its thread past step_timeout_s (that episode fails
                            "timeout", its sibling finishes), an isolated process that hangs (killed as
                            hung and replaced), the calculator fed a turn of thousands of unterminated
                            `<tool>` markers; a failed episode is trained with reward 0, as the job does
  consume                   the trainer's; its reply is sometimes lost (asked again), and sometimes sent
                            while the buffer is pending, given up on and retried while the first call still
                            waits (the first gives way, `ConsumeSuperseded`; the retry gets the batch)
  checkpoint, resume        every few steps a checkpoint (`jaxflow.trainer.checkpoint`: tiny arrays and the
                            service's snapshot as the extra, as the rl job saves it); now and then the newest
                            step is damaged (a wrong value, a missing key, a missing piece; on disk or
                            re-signed) and the run resumes: the restore with the job's `ExtraCheck` must pass
                            over the damaged step, naming it, and restore the one before; the service is
                            rebuilt from that snapshot and the trainer's ledger rolled back to its step

At the end it reports these, and exits 1 unless each holds:

  groups_lost           created - consumed - in flight - failed - surplus (the service's counters), plus
                        consumed groups missing from the surviving ledger
  groups_trained_twice  entries of the surviving ledger (the groups of every step whose parameters survive
                        the resumes) beyond its distinct groups
  staleness_violations  trained groups (and tokens) more than eta versions older than the step training them
  refusals              the service's refusal counters equal the refusals injected, by reason (both rolled
                        back with a resume, as the counters are restored from the snapshot)

and that every fault kind happened at least once and the service served at least `--ops` operations.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import pathlib
import random
import shutil
import socket
import sys
import tempfile
import threading
import time

import results_meta
import soak_episodes

from jaxflow.cluster.ray_actors import TRAJECTORY_SERVICE_METHODS
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.service_errors import REFUSAL_REASONS
from jaxflow.data.trajectory_service import ConsumeSuperseded, SampleRefused, TrajectoryService
from jaxflow.transport import rpc, wire

ETA, BATCH, N, LEASE, VOCAB, MAX_SEQ = 2, 3, 2, 0.2, 1000, 6000
TOKEN = "soak"
WORKERS = "abcde"
# Every kind of fault the run must have injected at least once.
FAULT_KINDS = ("lost_dispatch_reply", "duplicate_finish", "bad_sample", "bad_token_id_vocab", "bad_token_id_int32",
               "abort", "die", "hang", "late_refused", "lost_consume_reply", "consume_retry", "env_normal",
               "env_blocking", "env_hanging", "env_degenerate", "env_hang", "damaged_resume")
# The operations of the mix (what --ops counts): the soak's actions on the service, faults included.
OPERATIONS = ("dispatch", "finish", "abort", "die", "hang", "wake", "consume", "lost_dispatch_reply",
              "duplicate_finish", "bad_sample", "late_refused", "lost_consume_reply", "consume_retry", "checkpoint",
              "damaged_resume")
# Each bad sample: the refusal reason the service must give it.
BAD_KINDS = {"token_id_vocab": "token_id", "token_id_int32": "token_id", "too_long": "length",
             "reward_inf": "reward", "logprob_nan": "malformed", "future_version": "malformed"}
DAMAGE = (("wrong-value", False), ("missing-key", False), ("missing-piece", False), ("wrong-value", True),
          ("missing-key", True))


class Clock:
    """The fake lease clock, seconds, advanced by the soak."""

    t = 0.0

    def __call__(self):
        return self.t


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"soak: gave up waiting for {what} after {timeout_s} s")
        time.sleep(0.002)


def _tokens_of(gid: int, version: int, k: int = 2) -> Sample:
    return Sample([gid % 997] * k, [-0.25] * k, [version] * k, None)


class Soak:
    """One seeded soak run (see the module docstring); `ops` counts what happened, `violations` what broke."""

    def __init__(self, seed: int, workdir: pathlib.Path, save_every: int, damage_every: int, episode_p: float,
                 hang_groups: int):
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.workdir, self.save_every, self.damage_every = workdir, save_every, damage_every
        self.episode_p, self.hang_left = episode_p, hang_groups
        self.records = [{"prompt": [1 + i % 40, 2], "meta": {"i": i}} for i in range(100_000)]
        self.service = self._new_service()
        self._serve()
        self.v = 0  # the trainer's version
        self.workers = {w: {"version": 0, "held": {}, "alive": True, "dead_at": None} for w in WORKERS}
        self.sent: dict[int, list[Sample]] = {}  # group -> the samples its worker finished it with
        self.ledger: list[tuple[int, int]] = []  # (step, group) of every trained group whose step survives
        self.injected = collections.Counter()  # refusals injected, by reason (rolled back with a resume)
        self.injected_total = collections.Counter()  # ... over the whole run
        self.ops = collections.Counter()
        self.violations: list[str] = []
        self.retry: dict | None = None  # a consume retry in flight: {"thread", "result", "error"}
        self.saved: dict[int, dict] = {}  # checkpoint step -> the run's books at that step
        self.resumes: list[dict] = []
        self.episodes = soak_episodes.Episodes(step_timeout_s=1.0)
        self.ckpt, self.state_of = None, None

    # ---- the service --------------------------------------------------------------------------
    def _new_service(self) -> TrajectoryService:
        return TrajectoryService(PromptSource(self.records, shuffle=False, num_epochs=1), batch_groups=BATCH,
                                 group_size=N, eta=ETA, lease_s=LEASE, clock=self.clock, max_attempts=50,
                                 vocab_size=VOCAB, max_sequence_tokens=MAX_SEQ)

    def _serve(self) -> None:
        self.server = rpc.Server(self.service, list(TRAJECTORY_SERVICE_METHODS), token=TOKEN).start()
        self.client = rpc.Client(self.server.address, token=TOKEN)

    def close(self) -> None:
        if self.retry is not None:
            self.retry["thread"].join(timeout=60)
        self.client.close()
        self.server.close()
        self.episodes.close()
        if self.ckpt is not None:
            self.ckpt.close()

    def _call(self, method: str, *args, **kwargs):
        """One RPC call to the service (counted in rpc_calls)."""
        self.ops["rpc_calls"] += 1
        return getattr(self.client, method)(*args, **kwargs)

    def _violation(self, what: str) -> None:
        self.violations.append(f"step {self.ops['tick']}: {what}")

    # ---- workers ------------------------------------------------------------------------------
    def dispatch(self, w: str) -> None:
        st = self.workers[w]
        if self._call("needs_sync", st["version"]):
            st["version"] = self.v  # the trainer published v
        tasks = self._call("dispatch", w, st["version"], self.rng.randint(1, 3))
        if self.rng.random() < 0.1:  # the reply was "lost": the worker asks again; the first lot is orphaned
            self.ops["lost_dispatch_reply"] += 1
            tasks = self._call("dispatch", w, st["version"], 1)
        for t in tasks:
            st["held"][t.group_id] = t
        self.ops["dispatch"] += 1

    def _complete(self, w: str, t) -> tuple[list[Sample], list[float]]:
        """The group's finished samples and rewards: from episodes for some fresh groups, else scripted."""
        ver = self.workers[w]["version"]
        if not t.partial and self.rng.random() < self.episode_p:
            kind = self.rng.choice(soak_episodes.ENV_KINDS)
            # The first isolated group hangs its process; later ones do by chance, up to hang_groups in all.
            hang = kind == "hanging" and self.hang_left > 0 and (not self.ops["env_hang"] or self.rng.random() < 0.5)
            self.hang_left -= hang
            self.ops["env_hang"] += hang
            samples, rewards, failures = self.episodes.run_group(kind, t.prompt, t.n, ver, f"g{t.group_id}-{ver}",
                                                                  hang=hang)
            self._check_episodes(kind, hang, samples, failures)
            self.ops[f"env_{kind}"] += 1
            return samples, rewards
        out = []
        for i in range(t.n):
            prev = t.partial[i] if t.partial else Sample()
            new = _tokens_of(t.group_id, ver)
            out.append(Sample(prev.tokens + new.tokens, prev.logprobs + new.logprobs,
                              prev.versions + new.versions, "stop"))
        return out, [float(t.group_id % 2), 1.0]

    def _check_episodes(self, kind: str, hang: bool, samples: list[Sample], failures: list[str | None]) -> None:
        """What each environment must do to its own episodes (and only to them)."""
        if kind == "blocking":
            ok = failures[0] == "timeout" and all(f is None for f in failures[1:])
        elif kind == "hanging" and hang:
            ok = failures[0] == "timeout"  # its siblings share the hung process: they may fail with it
        elif kind == "degenerate":
            ok = all(f is None for f in failures) and all(
                len(s.tokens) == soak_episodes.DEGENERATE_TOKENS + 1 for s in samples)
        else:
            ok = all(f is None for f in failures)
        if not ok:
            self._violation(f"{kind} environment{' (hang)' if hang else ''}: episode failures {failures}")
        if any(f is not None and s.reward != 0.0 for f, s in zip(failures, samples)):
            self._violation(f"{kind} environment: a failed episode with a reward other than 0")

    def _bad(self, gid: int, w: str, samples: list[Sample], rewards: list[float]) -> None:
        """A finish the service must refuse, by the reason BAD_KINDS names; nothing may change but the count."""
        before = self._call("stats")
        bad = [Sample(list(s.tokens), list(s.logprobs), list(s.versions), s.finish_reason, [list(x) for x in
                      s.env_spans], s.reward) for s in samples]
        rewards = list(rewards)
        kind = self.rng.choice(sorted(BAD_KINDS))
        j = max(range(len(bad)), key=lambda i: len(bad[i].tokens))  # a sample with tokens to spoil
        s = bad[j]
        if not s.tokens:  # e.g. episodes whose environment failed before their first turn
            kind = "reward_inf"
        if kind == "token_id_vocab":
            s.tokens[0] = VOCAB
        elif kind == "token_id_int32":
            s.tokens[-1] = 2 ** 31
        elif kind == "too_long":
            extra = MAX_SEQ + 1 - len(s.tokens)
            bad[j] = Sample(s.tokens + [7] * extra, s.logprobs + [-0.5] * extra, s.versions + [s.versions[-1]] * extra,
                            "length", s.env_spans, s.reward)
        elif kind == "reward_inf":
            rewards[0] = math.inf
        elif kind == "logprob_nan":
            s.logprobs[0] = math.nan
        else:
            s.versions[0] = 10 ** 9
        reason = BAD_KINDS[kind]
        self.injected[reason] += 1
        self.injected_total[reason] += 1
        self.ops["bad_sample"] += 1
        self.ops[f"bad_{kind}"] += 1
        try:
            self._call("finish", gid, w, bad, rewards)
            self._violation(f"bad sample ({kind}) of group {gid} accepted")
        except SampleRefused as e:
            if e.reason != reason or f"group {gid}" not in str(e):
                self._violation(f"bad sample ({kind}) refused as {e.reason!r}: {e}")
        before["counts"]["refused"] += 1
        before["counts"][f"refused_{reason}"] += 1
        if self._call("stats") != before:
            self._violation(f"a refused finish ({kind}) changed more than its counters")

    def finish(self, w: str) -> None:
        st = self.workers[w]
        if not st["held"]:
            return
        gid = self.rng.choice(sorted(st["held"]))
        t = st["held"].pop(gid)
        samples, rewards = self._complete(w, t)
        if self.rng.random() < 0.15:
            self._bad(gid, w, samples, rewards)
        try:
            self._call("finish", gid, w, samples, rewards)
        except ValueError as e:  # a slow episode group: its lease may have run out meanwhile (fake clock)
            self._violation(f"finish of group {gid} refused: {e}")
            return
        self.sent[gid] = samples
        self.ops["finish"] += 1
        if self.rng.random() < 0.1:  # a duplicated request: refused, counted once
            try:
                self._call("finish", gid, w, samples, rewards)
                self._violation(f"a duplicated finish of group {gid} accepted")
            except (ValueError, KeyError):  # KeyError: consumed meanwhile (by a waiting consume), gone
                pass
            self.ops["duplicate_finish"] += 1

    def abort(self, w: str) -> None:
        st = self.workers[w]
        if st["held"]:
            gid = self.rng.choice(sorted(st["held"]))
            t = st["held"].pop(gid)
            ver = st["version"]
            partial = []
            for i in range(t.n):
                prev = t.partial[i] if t.partial else Sample()
                partial.append(Sample(prev.tokens + [gid % 997], prev.logprobs + [-0.25], prev.versions + [ver]))
            self._call("abort", gid, w, partial, "sync")
            self.ops["abort"] += 1

    def die(self, w: str, hang: bool = False) -> None:
        st = self.workers[w]
        st["alive"], st["dead_at"] = False, self.clock.t
        if not hang:
            st["held"] = {}
        self.ops["hang" if hang else "die"] += 1

    def wake(self, w: str) -> None:
        st = self.workers[w]
        # A hung worker comes back and tries to hand in what it held: refused if its lease expired.
        for gid, t in sorted(st["held"].items()):
            samples, rewards = self._complete(w, t)
            try:
                self._call("finish", gid, w, samples, rewards)
                self.sent[gid] = samples
            except ValueError as e:
                if not ("lease" in str(e) and w in str(e)):
                    self._violation(f"a late finish refused for another reason: {e}")
                self.ops["late_refused"] += 1
        st.update(alive=True, dead_at=None, held={})
        st["version"] = self.v
        self.ops["wake"] += 1

    # ---- trainer ------------------------------------------------------------------------------
    def _train(self, groups) -> None:
        if not groups:
            self._violation(f"consume({self.v}) handed over an empty batch")
        for g in groups:
            # (an episode whose environment failed before its first turn has no tokens)
            if self.v - g.v_start > ETA or any(self.v - min(s.versions, default=self.v) > ETA for s in g.samples):
                self.ops["staleness_violations"] += 1
                self._violation(f"group {g.group_id} trained at {self.v}, started at {g.v_start}")
            if g.samples != self.sent.get(g.group_id):
                self._violation(f"group {g.group_id} is not what its worker sent")
            self.ledger.append((self.v, g.group_id))
        self.v += 1
        self._call("mark_published", self.v)
        self.ops["consume"] += 1
        if self.v % self.save_every == 0:
            self.checkpoint()

    def _lose_consume_reply(self) -> None:
        """A trainer sends consume and its connection drops before the reply: the server consumes."""
        with socket.create_connection(self.server.address, timeout=5) as sock:
            wire.send_message(sock, {"token": TOKEN})
            wire.recv_message(sock, 1 << 20)
            wire.send_message(sock, {"id": 1, "method": "consume", "args": [self.v], "kwargs": {"timeout": 1}})
            self.ops["rpc_calls"] += 1
        _wait(lambda: self.client.progress()[0] != self.v, 10, "the server's consume")
        if self.client.progress()[0] != self.v + 1:
            self._violation("a consume whose reply was lost did not consume")
        self.ops["lost_consume_reply"] += 1

    def _start_retry(self) -> None:
        """consume(v) while the buffer is pending, from a client that gives up waiting (its socket times out)
        while the server's call still waits; the retry goes out then: the first call must give way
        (ConsumeSuperseded, counted once) and the retry, on a thread, gets the batch once the buffer fills."""
        v = self.v
        superseded = self.client.stats()["counts"]["consume_superseded"]
        with rpc.Client(self.server.address, token=TOKEN, timeout=0.2) as impatient:
            try:
                impatient.consume(v, timeout=60)
                self._violation(f"consume({v}) of a pending buffer returned")
            except TimeoutError:  # the client gave up; the server's call waits on
                pass
        self.ops["rpc_calls"] += 1
        _wait(lambda: self.client.stats()["consume_waiting"] == 1, 10, "the abandoned consume to wait")
        retry = {"error": None, "result": None}

        def call():
            with rpc.Client(self.server.address, token=TOKEN) as client:
                try:
                    retry["result"] = client.consume(v, timeout=60)
                except (ConsumeSuperseded, TimeoutError) as e:
                    retry["error"] = e

        retry["thread"] = threading.Thread(target=call, daemon=True, name="consume-retry")
        retry["thread"].start()
        self.ops["rpc_calls"] += 1
        _wait(lambda: self.client.stats()["counts"]["consume_superseded"] > superseded, 10,
              "the abandoned consume to give way")
        _wait(lambda: self.client.stats()["consume_waiting"] == 1 or not retry["thread"].is_alive(), 10,
              "the retry to wait")
        if self.client.stats()["counts"]["consume_superseded"] != superseded + 1:
            self._violation("consume_superseded did not count the abandoned consume once")
        self.retry = retry
        self.ops["consume_retry"] += 1

    def consume(self) -> None:
        if self.retry is not None:  # the retry's batch, once the buffer filled
            if self.retry["thread"].is_alive():
                return
            retry, self.retry = self.retry, None
            if retry["error"] is not None:
                self._violation(f"the consume retry failed: {retry['error']!r}")
                return
            batch = retry["result"]
            again = self._call("consume", self.v, timeout=5)  # the kept batch, asked again: not replaced
            if batch.step != self.v or again.groups != batch.groups:
                self._violation(f"the retry's batch {batch.step} was replaced by {again.step}")
            self._train(batch.groups)
            return
        if self._call("buffer_state", self.v) == "pending":
            if self.rng.random() < 0.15:
                self._start_retry()
            return
        if self.rng.random() < 0.3:
            self._lose_consume_reply()
        batch = self._call("consume", self.v, timeout=5)
        if self.rng.random() < 0.2:  # asked twice: the same batch
            if self._call("consume", self.v, timeout=5).groups != batch.groups:
                self._violation(f"consume({self.v}) asked twice gave two batches")
        if batch.step != self.v:
            self._violation(f"consume({self.v}) gave batch {batch.step}")
        self._train(batch.groups)

    # ---- checkpoints --------------------------------------------------------------------------
    def _checkpointer(self):
        if self.ckpt is None:
            import jax.numpy as jnp

            from jaxflow.trainer.checkpoint import Checkpointer

            self.ckpt = Checkpointer(self.workdir / "checkpoints", max_to_keep=3)
            self.state_of = lambda step: {"step": jnp.int32(step), "w": jnp.arange(4.0) * step}
        return self.ckpt

    def checkpoint(self) -> None:
        """Saves step v as the rl job does (the service's snapshot as the extra); now and then damages it and
        resumes."""
        ckpt = self._checkpointer()
        snap = self._call("snapshot")
        if not ckpt.save(self.v, self.state_of(self.v), {"trajectories": snap, "base_accuracy": None}):
            self._violation(f"checkpoint step {self.v} was not saved")
            return
        ckpt.wait_until_finished()
        self.saved[self.v] = {"ledger": len(self.ledger), "injected": collections.Counter(self.injected)}
        self.ops["checkpoint"] += 1
        if len(self.saved) > 1 and self.ops["checkpoint"] % self.damage_every == 0 and self.retry is None:
            self.damage_and_resume()

    def _damage(self, step: int, how: str, resign: bool) -> str:
        """Changes the trajectory snapshot in checkpoint `step`'s extra on disk (re-signed: its checksum too,
        so only the job's ExtraCheck can tell)."""
        from jaxflow.trainer import checkpoint

        path = self.workdir / "checkpoints" / str(step) / "extra" / "metadata"
        extra = json.loads(path.read_text())
        if how == "wrong-value":
            extra["trajectories"]["v_train"] += 1
        elif how == "missing-key":
            del extra["trajectories"]["counts"]
        else:
            del extra["trajectories"]
        sums = extra[checkpoint._EXTRA_CHECKSUMS]
        if resign:
            if "trajectories" in extra:
                sums["trajectories"] = checkpoint._json_digest(extra["trajectories"])
            else:
                sums.pop("trajectories", None)
        path.write_text(json.dumps(extra))
        return f"{how}{' (re-signed)' if resign else ''}"

    def damage_and_resume(self) -> None:
        """Damages the newest step and resumes: the restore must fall back to the step before, naming the damaged
        one; the service is rebuilt from the restored snapshot and the books rolled back to its step."""
        from jaxflow.jobs.resume import ExtraCheck

        newest = self.v
        previous = max(s for s in self.saved if s < newest)
        how, resign = DAMAGE[len(self.resumes) % len(DAMAGE)]
        what = self._damage(newest, how, resign)
        self.client.close()
        self.server.close()  # the old service is gone with its process
        self.service = self._new_service()
        state, extra = self.ckpt.restore(self.state_of(0), validate=ExtraCheck.for_service(self.service))
        damaged = self.ckpt.damaged
        if self.ckpt.restored_step != previous or int(state["step"]) != previous or [s for s, _ in damaged] != [
                newest] or "trajectories" not in damaged[0][1]:
            self._violation(f"resume after damage {what} of step {newest}: restored {self.ckpt.restored_step}, "
                            f"damaged {damaged}")
        for step, _ in damaged:  # out of the way of the steps redone now, as the job does
            self.ckpt.set_aside(step)
            self.saved.pop(step, None)
        self.service.restore(extra["trajectories"])
        self._serve()
        books = self.saved[previous]
        self.ledger = self.ledger[:books["ledger"]]
        if any(step >= previous for step, _ in self.ledger):
            self._violation("the ledger kept a step after the restored checkpoint")
        self.injected = collections.Counter(books["injected"])
        self.v = previous
        for st in self.workers.values():  # the rollout side restarts with the job
            st.update(version=previous, held={}, alive=True, dead_at=None)
        self.resumes.append({"damaged_step": newest, "damage": what, "restored_step": previous,
                             "why": damaged[0][1] if damaged else None})
        self.ops["damaged_resume"] += 1

    # ---- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        stats = self._call("stats")  # applies the leases that are due
        counts, groups = stats["counts"], stats["groups"]
        if counts["created"] != sum(groups.values()):
            self._violation(f"groups by state {groups} do not add up to created {counts['created']}")
        if counts["consumed"] != len(self.ledger):
            self._violation(f"the service consumed {counts['consumed']}, the ledger holds {len(self.ledger)}")
        for g in self._call("snapshot")["groups"]:
            if g["state"] == "running":
                st = self.workers[g["worker"]]
                # Nobody waits on a dead or hung worker's group for longer than the lease.
                if not st["alive"] and self.clock.t - st["dead_at"] > LEASE:
                    self._violation(f"group {g['group_id']} stayed with dead worker {g['worker']}")

    def step(self) -> None:
        self.clock.t += self.rng.uniform(0.0, 0.06)
        self.ops["tick"] += 1
        alive = [w for w, s in self.workers.items() if s["alive"]]
        for w in alive:  # live workers renew what they hold
            for gid in self._call("renew", w, sorted(self.workers[w]["held"])):
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
        if self.retry is None:  # a waiting consume holds the service's books open
            self.check()

    def operations(self) -> int:
        """Operations of the mix so far (OPERATIONS; the renewals and checks of every step not among them)."""
        return sum(self.ops[k] for k in OPERATIONS)

    def summary(self) -> dict:
        stats = self.client.stats()
        c = stats["counts"]
        in_flight = sum(v for k, v in stats["groups"].items() if k not in ("consumed", "failed", "surplus"))
        trained = [g for _, g in self.ledger]
        lost = abs(c["created"] - c["consumed"] - in_flight - c["failed"] - c["surplus"]) + max(
            c["consumed"] - len(set(trained)), 0)
        counted = {r: c[f"refused_{r}"] for r in REFUSAL_REASONS}
        injected = {r: self.injected[r] for r in REFUSAL_REASONS}
        faults = {k: self.ops[k] for k in FAULT_KINDS}
        return {
            "operations": self.operations(), "rpc_calls": self.ops["rpc_calls"], "steps": self.ops["tick"],
            "trained_version": self.v, "faults": faults,
            "operations_by_kind": {k: self.ops[k] for k in (*OPERATIONS, *FAULT_KINDS) if k in self.ops},
            "bad_samples_by_kind": {k: self.ops[f"bad_{k}"] for k in BAD_KINDS},
            "refusals_injected": injected, "refusals_counted": counted,
            "refusals_injected_over_run": {r: self.injected_total[r] for r in REFUSAL_REASONS},
            "refusals_match": injected == counted,
            "refusals_injected_all": sum(injected.values()), "refusals_counted_all": sum(counted.values()),
            "bad_token_ids": f"{self.ops['bad_token_id_vocab']} / {self.ops['bad_token_id_int32']}",
            "env_groups": " / ".join(str(self.ops[f"env_{k}"]) for k in soak_episodes.ENV_KINDS),
            "damaged_resumes": len(self.resumes),
            "consume_superseded": c["consume_superseded"], "expired": c["expired"],
            "episode_failures": dict(self.episodes.failures),
            "env_process_hung": self.episodes.isolated.hung, "env_process_restarts": self.episodes.isolated.restarts,
            "checkpoints": self.ops["checkpoint"], "resumes": self.resumes,
            "groups_lost": lost, "groups_trained_twice": len(trained) - len(set(trained)),
            "staleness_violations": self.ops["staleness_violations"], "ledger_groups": len(trained),
            "accounting": {"created": c["created"], "consumed": c["consumed"], "in_flight": in_flight,
                           "failed": c["failed"], "surplus": c["surplus"]},
            "missing_faults": [k for k, n in faults.items() if n == 0],
            "violations": self.violations[:20], "violations_total": len(self.violations),
        }


def run(quick: bool, seed: int, ops: int, workdir: pathlib.Path) -> dict:
    """Steps a Soak until the service served `ops` operations and every fault kind happened (at most 20 x ops
    steps); returns its summary."""
    from jaxflow.envs import isolated

    # The environment failures are the point here: the episode engine's warnings about them are expected.
    logging.getLogger("rollout_bridge.episodes").setLevel(logging.ERROR)
    isolated.PING_TIMEOUT_S = 0.5  # a hung environment process is found in half a second, not five
    soak = Soak(seed, workdir, save_every=max(4, ops // 250), damage_every=2, episode_p=0.08,
                hang_groups=2 if quick else 4)
    start = time.monotonic()
    try:
        while (soak.operations() < ops or any(soak.ops[k] == 0 for k in FAULT_KINDS)) \
                and soak.ops["tick"] < 20 * ops:
            soak.step()
        if soak.retry is not None:  # let the last retry land (the buffer fills as the steps go on)
            while soak.retry is not None and soak.ops["tick"] < 21 * ops:
                soak.step()
        soak.episodes.settle()
        out = soak.summary()
    finally:
        soak.close()
    out.update(quick=quick, seed=seed, ops_target=ops, run_s=round(time.monotonic() - start, 1))
    return out


def failures(out: dict) -> list[str]:
    """What fails the run: its invariants, a fault kind that never happened, too few operations."""
    bad = [f"{k}={out[k]}" for k in ("groups_lost", "groups_trained_twice", "staleness_violations") if out[k]]
    if not out["refusals_match"]:
        bad.append(f"refusals injected {out['refusals_injected']} != counted {out['refusals_counted']}")
    if out["env_process_hung"] != out["faults"]["env_hang"]:
        bad.append(f"{out['faults']['env_hang']} environment processes hung, {out['env_process_hung']} killed as hung")
    if out["missing_faults"]:
        bad.append(f"fault kinds that never happened: {', '.join(out['missing_faults'])}")
    if out["operations"] < out["ops_target"]:
        bad.append(f"only {out['operations']} operations on the service (wanted {out['ops_target']})")
    if out["violations_total"]:
        bad.append(f"{out['violations_total']} checks failed, first: {out['violations'][0]}")
    return bad


def print_table(out: dict) -> None:
    print(f"\n{'operation or fault':<22}{'count':>8}   (env_*: groups of episodes on that environment)")
    for k, n in out["operations_by_kind"].items():
        print(f"{k:<22}{n:>8}")
    print(f"\n{'refusal reason':<22}{'injected':>9}{'counted':>9}")
    for r in REFUSAL_REASONS:
        print(f"{r:<22}{out['refusals_injected'][r]:>9}{out['refusals_counted'][r]:>9}")
    print(f"\noperations {out['operations']} over {out['steps']} steps, trained to "
          f"version {out['trained_version']}; checkpoints {out['checkpoints']}, resumes from a damaged step "
          f"{len(out['resumes'])}; episode failures {out['episode_failures']}; environment processes killed as "
          f"hung {out['env_process_hung']}; consume calls superseded {out['consume_superseded']}")
    damages = collections.Counter(r["damage"] for r in out["resumes"])
    print(f"damaged steps resumed past: {dict(damages)}; RPC calls {out['rpc_calls']}")
    print(f"groups_lost {out['groups_lost']}   groups_trained_twice {out['groups_trained_twice']}   "
          f"staleness_violations {out['staleness_violations']}   refusals counted "
          f"{'= injected' if out['refusals_match'] else '!= injected'}   run {out['run_s']:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2,000 operations (else 5,000) and at most 2 hung environment processes (else 4)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", type=int, default=None,
                        help="operations on the service, at least (default 2000; 5000 without --quick)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ops is not None and args.ops < 1:
        raise SystemExit(f"--ops must be >= 1, got {args.ops}")
    meta_started = results_meta.begin(argv)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxflow-soak-"))
    try:
        out = run(args.quick, args.seed, args.ops or (2000 if args.quick else 5000), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(out)
    if args.json:
        results_meta.write_json(args.json, out, meta_started)
    bad = failures(out)
    if bad:
        print(f"soak: FAILED: {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
