"""A together-group's process, `python -m tunelab.cell --together --name NAME RUN_DIR...`: several cells' adapters
trained over one base model loaded once (run/together.py plans the groups; the runner starts this process, hands it
the members' folder locks and steers it).

Each member is a cell as it is alone: its own folder, status, lock, metrics, checkpoints, final/, evaluation and
W&B run, written by the cell's own code (cell/attempt.py, cell/stages.py, cell/evaluation.py). Shared, built once:
the base model, the tokenizer, the datasets. How members step over the shared base, each exactly as alone:
train/members.py.

The runner speaks on stdin, one JSON object a line:
    {"op": "train", "members": {"0": {"stop_at": 2, "validate_at": [2]}, ...}}
        train these members in lockstep (step s of each, then s + 1), each up to its stop_at (a search's rung:
        validated, checkpointed, status pending with paused_at, and kept in memory to go on when asked again,
        with no checkpoint read) or to its end (final/, its evaluation, status done)
    {"op": "release", "members": [1, 3]}
        forget these members (pruned, or no longer wanted here): their adapters and optimizers freed, their folder
        locks let go
    {"op": "end"} (or the end of stdin)
        exit
and answers with events on stdout, each member's tagged with its number (core/events.py), and `Ready` when an
operation is done. A member that fails fails alone: status failed with its traceback (in its cell.log too), its
adapter dropped, the others go on. A stop signal (Ctrl-C, SIGTERM: the runner passes them on) ends the round:
each member in training checkpoints where it is and says pending, and the process exits. Its own log (stderr) is
runs/<matrix>/.together/NAME/worker.log (NAME: the group's key, the runner's pid and a count); where its time and
memory went, .together/NAME/record.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.cell import evaluation, stages
from tunelab.cell.assembly import build_data, load_model, rss_mb
from tunelab.cell.attempt import Attempt, start
from tunelab.cell.process import LOCK_WAIT_S, line_stream
from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core import events
from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.events import Emit, Ready, Stage
from tunelab.core.files import write_json
from tunelab.core.locks import LOCK_FDS_ENV, LOCKED_EXIT, CellLock, lock_holder
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.machine.runtime import STOP, Paused, Preempted, stop_agreed

USAGE = "usage: python -m tunelab.cell --together --name NAME [--mode exact|batched] RUN_DIR [RUN_DIR ...]"


@dataclass
class Seat:
    """One member's place in the group: its folder and config, the lock it holds, and where it stands."""

    k: int
    folder: CellFolder
    cfg: CellConfig
    lock: int | CellLock  # the descriptor the runner handed over, or the lock taken here
    state: str = "waiting"  # waiting | training | trained | paused | done | failed | released
    rng: dict | None = None  # the random state right after its adapter was injected, until it is set up
    member: Any = None  # train.members.Member once set up
    attempt: Attempt | None = None  # this operation's attempt (status, events, W&B)
    val_loss: float | None = None  # its final validation loss, for its evaluation
    trained_from: int = 1  # its first step in this operation
    train_s: float = 0.0  # seconds of its own turns in this attempt (steps, validation, checkpoints)
    turns_s: float = 0.0  # and in all its attempts in this process
    joined: int = 0  # batched mode: its steps in this process that joined the group's passes
    refused: UserError | None = None  # why its adapter could not join the group's model (it fails when asked)


@dataclass
class Group:
    name: str  # <key>-<runner pid>-<n>: its log and record under runs/<matrix>/.together/
    seats: list[Seat]
    write: Any  # a line to the runner
    model: Any = None
    tokenizer: Any = None
    datasets: dict | None = None
    rt: Any = None
    peak: float | None = None  # the device's peak FLOPs (metrics' MFU)
    shared: dict = field(default_factory=dict)  # what members share on the output head (train/members.py)
    record: dict = field(default_factory=dict)  # .together/<name>/record.json
    rss_before: float = 0.0
    longest: int | None = None  # the longest training row (the memory model's sequence length)
    mode: str = "exact"  # exact | batched (train/batched.py): how members' steps meet the base
    unbatched: str | None = None  # batched mode: why this group's base cannot take a joined pass (then exact)
    parked: list = field(default_factory=list)  # what members that left held, kept from malloc (`_park`)

    def emit(self, k: int) -> Emit:
        return lambda event: self.write(events.encode(event, member=k))

    @property
    def matrix(self) -> MatrixFolder:
        return MatrixFolder(self.seats[0].folder.path.parent)

    def info(self, seat: Seat) -> dict:
        """What status.json and the summary say of the group a member runs in."""
        info = {"group": self.name, "member": seat.k, "members": len(self.seats), "pid": os.getpid(),
                "log": str(self.matrix.together_log(self.name)), "mode": self.mode}
        if self.mode == "batched":
            why = self._why_not_batched(seat)
            info["batched"] = f"steps exact: {why}" if why else f"{seat.joined} steps in the group's passes"
        return info

    def _why_not_batched(self, seat: Seat) -> str | None:
        """None when the member's rows join the group's batched passes; else why it steps exact."""
        from tunelab.run.together import why_not_batched

        return self.unbatched or why_not_batched(seat.cfg)

    # -- operations ------------------------------------------------------------------------------------------
    def train(self, asks: dict[int, tuple[int | None, tuple[int, ...]]]) -> None:
        seats = [self.seats[k] for k in sorted(asks) if self.seats[k].state in ("waiting", "paused")]
        for seat in seats:
            self._attempt(seat, *asks[seat.k])
            if seat.refused is not None and seat.state == "training":
                self._fail(seat, seat.refused)
        if self.model is None and any(s.state == "training" for s in seats):
            try:
                self._load([s for s in seats if s.state == "training"])
            except (Preempted, KeyboardInterrupt):
                raise
            except BaseException as e:  # noqa: BLE001 - the base is every member's: each says so
                for seat in seats:
                    if seat.state == "training":
                        self._fail(seat, e)
                return
        for seat in seats:
            if seat.state == "training":
                self._begin(seat)
        STOP.armed = True
        try:
            self._rounds([s for s in seats if s.state == "training"])
        finally:
            STOP.armed = False
        self._evaluate([s for s in seats if s.state == "trained"])

    def release(self, ks: list[int]) -> None:
        for k in ks:
            seat = self.seats[k]
            if seat.state in ("training", "trained"):
                continue  # (operations run one at a time: not reached)
            self._drop(seat)
            if seat.state in ("waiting", "paused"):
                seat.state = "released"
            _let_go(seat)

    def end(self) -> None:
        for seat in self.seats:
            _let_go(seat)

    # -- the parts -------------------------------------------------------------------------------------------
    def _attempt(self, seat: Seat, stop_at: int | None, validate_at: tuple[int, ...]) -> None:
        """A new attempt at the member: status running (with its group), its W&B run, this machine checked."""
        from tunelab.machine import runtime

        rt = self.rt or runtime.resolve(seat.cfg)
        attempt = seat.attempt = Attempt(seat.folder, seat.cfg, rt, self.emit(seat.k), stop_at=stop_at,
                                         validate_at=validate_at)
        seat.train_s = 0.0
        try:
            start(attempt, evaluate_only=False, together=self.info(seat))
            runtime.check_host(seat.cfg, file=seat.folder.config_file)
            self.rt = rt
            seat.state = "training"
        except (Preempted, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - this member fails, the group goes on
            self._fail(seat, e)

    def _load(self, seats: list[Seat]) -> None:
        """The base and the data once, then every member's adapter, each drawn from its own seed."""
        import torch
        from transformers import set_seed

        from tunelab.data import build  # noqa: F401 - before the baseline below: libraries are not training
        from tunelab.train import checkpoint, members
        from tunelab.train.metrics import peak_flops

        first = seats[0].attempt
        assert first is not None
        everyone = self._to(seats)
        self.rss_before = rss_mb()
        everyone(Stage("load"))
        t0 = time.perf_counter()
        set_seed(first.cfg.train.seed)  # as a cell alone: loading and data building draw on forks
        with torch.random.fork_rng(devices=[]):
            model, self.tokenizer, files = load_model(Attempt(first.folder, first.cfg, first.rt, everyone))
            t1 = time.perf_counter()
            self.datasets = build_data(Attempt(first.folder, first.cfg, first.rt, everyone), self.tokenizer)
        assert files is None, "a together-group runs on one process"
        t2 = time.perf_counter()
        for seat in self.seats:  # every member's, in order: an adapter's init draws on its own seed only
            try:
                model = members.inject(model, members.member_name(seat.k), seat.cfg)
            except UserError as e:  # found before peft touched the model: this member fails, the others go on
                seat.refused = e
                if seat.state == "training":
                    self._fail(seat, e)
                continue
            seat.rng = checkpoint.rng_state()
        self.model, self.peak = model, peak_flops(first.rt.device)
        if self.mode == "batched":
            from tunelab.train.batched import unroutable

            self.unbatched = unroutable(model)
            if self.unbatched:
                print(f"batched mode: every member steps exact: {self.unbatched}", file=sys.stderr, flush=True)
        self.record.update(load_s=t1 - t0, data_s=t2 - t1, inject_s=time.perf_counter() - t2,
                           rss_before_load_mb=self.rss_before)

    def _begin(self, seat: Seat) -> None:
        """The member set up (its loop, resumed from its latest checkpoint), or, kept in memory since its last
        pause, told how far to go now."""
        from tunelab.train import loop, members
        from tunelab.train.validation import Validation

        attempt = seat.attempt
        assert attempt is not None
        t0 = time.perf_counter()
        try:
            if seat.member is None:
                self.parked.clear()  # a member's optimizer state comes now: the memory is wanted back
                cfg, datasets = seat.cfg, self.datasets
                assert datasets is not None

                def make_loop(names):
                    return loop.setup(self.model, self.tokenizer, datasets, cfg, seat.folder, attempt.emit,
                                      runtime=attempt.rt, validation=Validation.of(cfg.eval),
                                      retention=StepScores(seat.folder, cfg), stop_at=attempt.stop_at,
                                      validate_at=attempt.validate_at, names=names)

                assert seat.rng is not None
                seat.member = members.setup(seat.k, self.model, seat.rng, self.shared, make_loop)
                seat.rng, self.longest = None, seat.member.loop.longest
            else:  # continues in memory: no process start, no checkpoint read
                m = seat.member
                m.loop.emit, m.loop.stop_at, m.loop.validate_at = attempt.emit, attempt.stop_at, \
                    frozenset(attempt.validate_at)
                if m.paused_at is not None:
                    m.loop.continued_in_memory_from.append(m.paused_at)
                    m.paused_at = None
            m = seat.member
            m.loop.together = self.info(seat)
            attempt.timings["setup_s"] = time.perf_counter() - t0  # its own (the group's load: record.json)
            seat.trained_from = m.next
            paused = loop.paused_before(m.loop, m.next)
            if paused is not None:
                self._pause(seat, paused)
        except (Preempted, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001
            self._fail(seat, e)

    def _rounds(self, seats: list[Seat]) -> None:
        """Lockstep: step s of every member that has it next, then s + 1; after each round, a stop signal ends it."""
        from tunelab.train import loop

        while live := [s for s in seats if s.state == "training"]:
            step = min(s.member.next for s in live)
            due = [s for s in live if s.member.next == step]
            joined = self._joined(due) if self.mode == "batched" else {}
            ended: list[tuple[Seat, int | None]] = []  # at their rung (its step) or their end (None) this round
            for seat in due:
                m = seat.member
                if seat.state != "training":  # failed in the joined pass
                    continue
                t0 = time.perf_counter()
                try:
                    with m.turn():
                        try:
                            loop.advance(m.loop, step, self.peak, done=joined.get(seat.k))
                        finally:
                            m.next = step + 1
                    if step >= loop.last_step(m.loop):
                        ended.append((seat, None))
                except Paused as p:
                    ended.append((seat, p.step))
                except (Preempted, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - this member fails, the group goes on
                    self._fail(seat, e)
                spent = time.perf_counter() - t0
                seat.train_s, seat.turns_s = seat.train_s + spent, seat.turns_s + spent
            self._ended(ended)
            if stop_agreed(self.rt.layout):
                self._stop(seats)
                raise Preempted(STOP.signal or "a stop signal")

    def _ended(self, ended: list[tuple[Seat, int | None]]) -> None:
        """The round's members at their rung or their end: the checkpoints they ask scores of, up to there, scored
        over the group's base first (checkpoint_scores/shared.py: in shared passes where they can be, no base loaded
        again; each member's own settle then finds them done), then each paused or trained."""
        from tunelab.checkpoint_scores import shared

        askers = [shared.Asker(s.folder, s.cfg, s.member.name, paused, s.attempt.emit, s.attempt.timings)
                  for s, paused in ended if s.cfg.eval.checkpoints is not None and s.attempt is not None]
        if askers:
            shared.score(self.model, self._scoring_model, self.tokenizer, self.datasets, askers)
        for seat, paused in ended:
            t0 = time.perf_counter()
            try:
                if paused is not None:
                    self._pause(seat, paused)
                else:
                    with seat.member.turn():
                        self._trained(seat)
            except (Preempted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - this member fails, the group goes on
                self._fail(seat, e)
            seat.turns_s += time.perf_counter() - t0

    def _joined(self, due: list[Seat]) -> dict[int, Any]:
        """Batched mode: the backward passes of this step of every member that can join, in one pass per micro-batch
        (train/batched.py) -> {member: loop.Backward}; the others step exact in their turns. A pass that fails
        fails its members (it was theirs alone together)."""
        from tunelab.train import batched, loop
        from tunelab.train.data import label_tokens

        ready = [s for s in due if self._why_not_batched(s) is None]
        if len(ready) < 2:
            return {}
        t0 = time.perf_counter()
        try:
            micro = []
            for seat in ready:  # each draws its batches as alone, its random streams in place
                m = seat.member
                with m.turn():
                    micro.append([next(m.loop.stream) for _ in range(m.cfg.train.grad_accum)])
            first = ready[0].member.loop
            with first.attention():
                done = batched.backward([s.member for s in ready], micro,
                                        [sum(label_tokens(b) for b in mb) for mb in micro],
                                        self.tokenizer.pad_token_id, first.runtime.device, first.runtime.precision)
        except (Preempted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - the pass's members fail, the group goes on
            for seat in ready:
                self._fail(seat, e)
            return {}
        spent = (time.perf_counter() - t0) / len(ready)
        for seat in ready:
            seat.train_s, seat.turns_s, seat.joined = seat.train_s + spent, seat.turns_s + spent, seat.joined + 1
        return {s.k: loop.Backward(micro[j], done.losses[j], done.seconds) for j, s in enumerate(ready)}

    def _trained(self, seat: Seat) -> None:
        """Its last step done (in a turn of its own, after the round): final validation, summary, final/,
        memory.json, checkpoints' scores; its optimizer freed. Its evaluation comes with the others' (`_evaluate`)."""
        from tunelab.train import loop

        attempt, m = seat.attempt, seat.member
        assert attempt is not None
        m.loop.together = self.info(seat)  # (batched mode: how many of its steps joined the passes)
        result = loop.finish(m.loop, m.resumed_from)
        attempt.timings["train_s"] = seat.train_s
        attempt.timings["checkpoint_s"] = m.loop.spent.get("checkpoint_s", 0.0)
        seat.val_loss = stages.trained(attempt, result, self.tokenizer, [self.rss_before],
                                       together={**self.info(seat), "note": "peak_mb is the whole group's process"})
        self._park(m.loop)
        m.loop = None  # its optimizer, schedule and batches go (parked)
        seat.state = "trained"

    def _evaluate(self, seats: list[Seat]) -> None:
        """The trained members' final evaluation, over the shared base, unmerged. Members that share an eval section
        and whose adapters evaluation can route (LoRA, DoRA, IA3 Linear layers of the body: evals/engine/route.py)
        are scored together in shared passes; any other member alone, its adapter active."""
        from tunelab.evals.engine import route

        by_section: dict[str, list[Seat]] = {}
        for seat in seats:
            assert seat.attempt is not None
            by_section.setdefault(seat.attempt.cfg.eval.id(), []).append(seat)
        for same in by_section.values():
            if len(same) > 1 and route.unroutable(self.model, [s.member.name for s in same]) is None:
                try:
                    self._evaluate_together(same)
                except (Preempted, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - one member's broken evaluation must not fail the others
                    print(f"members {[s.k for s in same]} evaluated together failed ({type(e).__name__}: {e}); each "
                          "is evaluated alone", file=sys.stderr, flush=True)
                else:
                    self._scored(same, lambda: None)
                    continue
            for seat in same:
                self._scored([seat], lambda seat=seat: self._evaluate_alone(seat))

    def _evaluate_together(self, seats: list[Seat]) -> None:
        attempts = [s.attempt for s in seats if s.attempt is not None]
        evaluation.run_together(attempts, self._scoring_model(), [s.member.name for s in seats], self.tokenizer,
                                self.datasets, [s.val_loss for s in seats])

    def _scoring_model(self) -> Any:
        from tunelab.train.modes import set_training
        from tunelab.train.parallel.anatomy import causal_lm

        set_training(self.model, False)
        return causal_lm(self.model)

    def _evaluate_alone(self, seat: Seat) -> None:
        from tunelab.train import members

        assert seat.attempt is not None
        members.activate(self.model, seat.member.name)
        evaluation.run(seat.attempt, self._scoring_model(), self.tokenizer, self.datasets, seat.val_loss,
                       unmerged=True)

    def _scored(self, seats: list[Seat], score: Any) -> None:
        """Run `score` for these members; each is then done (or, when it raised, failed), its folder let go."""
        try:
            score()
        except (Preempted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            for seat in seats:
                self._fail(seat, e)
            return
        for seat in seats:
            assert seat.attempt is not None
            try:
                stages.done(seat.attempt)
                seat.state = "done"
            except (Preempted, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                self._fail(seat, e)
                continue
            self._drop(seat)
            _let_go(seat)  # done: its folder is free (the runner closes its own copy too)

    def _pause(self, seat: Seat, step: int) -> None:
        """At its rung: pending with paused_at (the cell's own `pause`), kept in memory."""
        assert seat.attempt is not None
        seat.attempt.timings["train_s"] = seat.train_s
        try:
            stages.pause(seat.attempt, step)
            seat.member.paused_at, seat.state = step, "paused"
        except (Preempted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            self._fail(seat, e)

    def _fail(self, seat: Seat, e: BaseException) -> None:
        """This member failed: status failed with its traceback (in its cell.log too), its adapter dropped."""
        text = "".join(traceback.format_exception(e))  # (also outside the except that caught it: a refused member)
        print(f"member {seat.k} ({seat.folder.path.name}) failed:\n{text}", file=sys.stderr, flush=True)
        with seat.folder.log_file.open("a") as log:
            log.write(text)
        if seat.attempt is not None:
            stages.failed(seat.attempt, e)
        seat.state = "failed"
        self._drop(seat)
        _let_go(seat)

    def _stop(self, seats: list[Seat]) -> None:
        """A stop signal: each member in training checkpoints where it is (in its turn) and says pending."""
        from tunelab.train import loop

        for seat in seats:
            if seat.state != "training":
                continue
            m, attempt = seat.member, seat.attempt
            assert attempt is not None
            if m.next - 1 >= seat.trained_from:  # it trained a step since its checkpoint
                with m.turn():
                    loop.checkpoint_now(m.loop, m.next - 1)
            attempt.timings["train_s"] = seat.train_s
            stages.stopped(attempt, Preempted(STOP.signal or "a stop signal", m.next - 1))
            seat.state = "waiting"

    def interrupted(self, stop: Preempted | None = None) -> None:
        """Stopped (a stop signal outside the rounds: `stop`) or a second Ctrl-C: every member still in training or
        evaluation says pending, to go on from its last checkpoint (or evaluate again) on the next run."""
        for seat in self.seats:
            if seat.state in ("training", "trained") and seat.attempt is not None:
                if stop is not None:
                    stages.stopped(seat.attempt, stop)
                else:
                    stages.interrupted(seat.attempt)
                seat.state = "waiting"

    def _drop(self, seat: Seat) -> None:
        """The member's adapter and training gone from the group's model (their tensors parked)."""
        from tunelab.train import members

        name = seat.member.name if seat.member is not None else members.member_name(seat.k)
        if self.model is not None and (seat.member is not None or seat.rng is not None):
            self._park(seat.member, members.Index.of(self.model).params.get(name))
            members.remove(self.model, name)
        seat.member, seat.rng = None, None

    def _park(self, *held: Any) -> None:
        """What a member that leaves (released, failed, trained) held, kept rather than handed back to malloc while
        the others go on. glibc puts each later step's tensors in the holes those frees leave, and the remaining
        members' steps ran 10-20% slower for the rest of the run (measured: a 16-trial SmolLM2 search, rungs 2 and
        3, not so when the same tensors were kept or under tcmalloc). It costs no peak: the group held them all
        before. Let go when a member that was not set up yet is (`_begin`), and at exit."""
        self.parked.extend(h for h in held if h is not None)

    def _to(self, seats: list[Seat]) -> Emit:
        def emit(event) -> None:
            for s in seats:
                if s.attempt is not None:
                    s.attempt.emit(event)

        return emit

    def write_record(self, started: float) -> None:
        """.together/<name>/record.json: where the process's time and memory went."""
        import psutil

        from tunelab.train.metrics import peak_memory_mb
        from tunelab.train.parallel.predict import group_peak_mb

        steps = {s.k: s.turns_s for s in self.seats}
        peak, kind = peak_memory_mb(self.rt.device) if self.rt is not None else (None, None)
        predicted = None
        if self.model is not None and self.rt is not None:  # what `exp memory --together` predicts for it
            predicted = group_peak_mb(self.model.config, [s.cfg for s in self.seats],
                                      str(self.rt.dtype).removeprefix("torch."), seq=self.longest,
                                      batched=self.mode == "batched")
        self.record.update(name=self.name, pid=os.getpid(), members=[str(s.folder.path) for s in self.seats],
                           states={s.k: s.state for s in self.seats}, turns_s=steps,
                           import_s=started - psutil.Process().create_time(), wall_s=time.time() - started,
                           peak_mb=peak, peak_kind=kind, predicted_peak_mb=predicted)
        write_json(self.matrix.together_record(self.name), self.record)


def _let_go(seat: Seat) -> None:
    """The member's folder lock let go here (the runner closes its own copy)."""
    if isinstance(seat.lock, CellLock):
        seat.lock.release()
    elif seat.lock >= 0:
        try:
            os.close(seat.lock)
        except OSError:
            pass
        seat.lock = -1


def _locks(dirs: list[Path]) -> list[int | CellLock]:
    """Each member folder's lock: the descriptor the runner handed over, else taken here (started by hand)."""
    handed = {str(Path(p).resolve()): fd for p, fd in json.loads(os.environ.get(LOCK_FDS_ENV) or "{}").items()}
    out: list[int | CellLock] = []
    for d in dirs:
        fd = handed.get(str(d))
        if fd is not None:
            out.append(int(fd))
            continue
        held = CellLock(d)
        if not held.acquire(wait=LOCK_WAIT_S):
            for taken in out:
                if isinstance(taken, CellLock):
                    taken.release()
            raise _LockedOut(d)
        out.append(held)
    return out


class _LockedOut(Exception):
    pass


def _asks(body: dict) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    return {int(k): (v.get("stop_at"), tuple(v.get("validate_at") or ())) for k, v in body["members"].items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "--name":
        print(USAGE, file=sys.stderr)
        return 2
    from tunelab.machine.runtime import catch_stop_signals

    started = time.time()
    name, rest = argv[1], argv[2:]
    mode = "exact"
    if rest[:1] == ["--mode"] and len(rest) >= 3 and rest[1] in ("exact", "batched"):
        mode, rest = rest[1], rest[2:]
    dirs = [Path(p).resolve() for p in rest]
    write = line_stream()
    catch_stop_signals()
    try:
        held = _locks(dirs)
    except _LockedOut as e:
        print(f"{e.args[0]} is locked by {lock_holder(e.args[0])}", file=sys.stderr)
        return LOCKED_EXIT
    folders = [CellFolder(d) for d in dirs]
    group = Group(name, [Seat(k, f, f.config(), lock) for k, (f, lock) in enumerate(zip(folders, held))], write,
                  mode=mode)
    code = 0
    try:
        while line := sys.stdin.readline():
            body = json.loads(line)
            op = body.get("op")
            if op == "train":
                group.train(_asks(body))
            elif op == "release":
                group.release([int(k) for k in body["members"]])
            elif op == "end":
                break
            group.write_record(started)
            write(events.encode(Ready(op)))
    except Preempted as e:  # a stop signal: members in training checkpointed and said pending
        group.interrupted(e)
        print(f"stopped: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        group.interrupted()
        code = 130
    finally:
        group.end()
        group.write_record(started)
    return code
