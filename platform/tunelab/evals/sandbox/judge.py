"""The judge: runs a task's tests in a process of its own, outside the sandbox.

`contain.py` passes `wire.py` and then this file's text to `python -I -S -c`,
with the job (the context, the tests and the names to call) on stdin. The context (for
HumanEval, the prompt: its helpers and imports) and the tests run here; each name in
`calls` stands for the program's function of that name in the sandbox.

The program must learn nothing about its verdict, not even across runs (a program that
learned from one run whether a guess was right could keep that in any state that outlives
the run and pass a later sample). So the calls it gets cannot depend on its answers, and
the judge works in three phases:

1. plan: the tests run here with every call answered by a stand-in that takes part in any
   operation without raising (it iterates as empty, compares unequal, is false), asserts
   that fail (or raise) ignored rather than raised, `and`/`or`, `x if c else y` and
   all()/any() over a generator evaluated in full. The arguments of every call the tests
   could make, in order, are the plan. The tests' randomness (`random`, os.urandom) comes
   from a secret drawn per run, the same for the plan and the check.
2. ask: the planned calls go to the program one after the other, each sent as soon as the
   previous answer arrived, none decoded, whatever the answers are. At the deadline the
   judge stops asking; the program's run then ends (the evaluator kills it) before:
3. check: prepared before the program answers anything (the context run in a fresh
   namespace, the tests rewritten and compiled), so that none of it is part of the time a
   verdict takes. Every answer is decoded (within one budget), then the tests run, each call
   answered from phase 2 by the planned call with the same arguments, every operand
   evaluated as in planning, to their end: a failed assert or an error is recorded and the
   tests go on; the first failure is the verdict, and a traceback is formatted whatever it
   is. So the check takes as long whichever answers were right, and the time from the
   program's end to the next program's start says nothing of the verdict (beyond the
   comparisons themselves: builtin `==` on plain data). A call the plan lacks means the
   tests' inputs depend on the program's answers (no HumanEval test does): that run is
   scored failed, not asked.

Only if the check records no failure does this process write "passed" to the verdict pipe,
which the program has no handle on. Argument order: call_fd answer_fd verdict_fd done_fd
go_fd deadline (time.monotonic) cpu_s memory_bytes.
"""

import ast
import bisect
import builtins
import os
import random
import resource
import sys

if TYPE_CHECKING:  # noqa: F821 (wire.py, prepended)
    from collections.abc import Callable
    from typing import Any

MAX_CALLS = 100_000  # calls one run's tests may plan
MAX_ANSWER_BYTES = 16 << 20  # answers kept in total: past that, an answer is refused


class _Stop(BaseException):
    """Ends the tests with the judge's verdict. Not an Exception, so that the tests' own
    `except Exception` cannot swallow it."""

    def __init__(self, verdict: str, why: str) -> None:
        super().__init__(why)
        self.verdict = verdict


def main() -> None:
    call_fd, answer_fd, verdict_fd, done_fd, go_fd = map(int, sys.argv[1:6])
    deadline, cpu_s, memory = float(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    for res, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    job = decode(sys.stdin.buffer.read())  # noqa: F821 (the evaluator's, in the wire's format)
    seed = int.from_bytes(os.urandom(8), "little")
    plan, cut = _plan(job, seed)
    prepared = _prepared(job, seed)  # before the program answers: no part of the time its verdict takes
    answers = _ask(plan, call_fd, answer_fd, deadline)
    os.close(call_fd)  # the program reads the end of its calls and exits
    os.close(answer_fd)
    os.write(done_fd, b"D")
    os.read(go_fd, 1)  # returns once the evaluator has ended the program: nothing below reaches it
    verdict = _check(job, plan, answers, cut, prepared)
    os.write(verdict_fd, f"{verdict} {_peak_kb()}".encode())


def _peak_kb() -> int:
    """This process's peak resident memory. Not ru_maxrss: that keeps the evaluator's, which
    this process was forked from, across the exec."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)


def _namespace(job: dict, seed: int) -> dict:
    """A fresh namespace with the context run in it, and the tests' randomness reset: `random`,
    and os.urandom (so `secrets` and uuid4 too) as a stream from the run's secret seed, so
    that the plan and the check draw the same inputs, which the program cannot foresee."""
    random.seed(seed)
    stream = random.Random(seed ^ 0x5EED)
    os.urandom = random._urandom = stream.randbytes  # type: ignore[attr-defined]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["context"], "context.py", "exec"), namespace)
    return namespace


# --------------------------------------------------------------------------- 1. plan


def _plan(job: dict, seed: int) -> tuple[list[bytes], str | None]:
    """The calls the tests could make, in order, and why the plan stopped early, if it did.
    (Planning that never ends is ended by the evaluator, at the deadline plus its margins.)"""
    plan: list[bytes] = []
    try:
        namespace = _namespace(job, seed)
        namespace.update(__tunelab_and=_and, __tunelab_or=_or, __tunelab_ifexp=_ifexp)
        for name in job["calls"]:
            namespace[name] = _recorder(name, plan)
        tree = _Planning().visit(ast.parse(job["tests"], "tests.py"))
        exec(compile(ast.fix_missing_locations(tree), "tests.py", "exec"), namespace)
    except _Stop as stop:  # too many calls
        return plan, str(stop)
    except BaseException:  # an error of the tests outside any assert: the check meets it too
        pass
    return plan, None


def _recorder(name: str, plan: list[bytes]) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        try:
            plan.append(encode((name, args, kwargs)))  # noqa: F821 (wire.py, prepended)
        except TypeError:  # not data (a stand-in among them): not asked; the check meets the call anew
            return _ANYTHING
        if len(plan) > MAX_CALLS:
            raise _Stop("failed", f"the tests would call the program more than {MAX_CALLS} times")
        return _ANYTHING

    return call


class _Anything:
    """The planner's answer to every call: whatever the tests do with it, they go on (HumanEval/33
    compares tuple(candidate(x)) with tuple(sort_third(x)): a None answer would stop the
    assert before its second call)."""

    def _same(self, *args: object, **kwargs: object) -> object:
        return self

    __getattr__ = __call__ = __getitem__ = __neg__ = __pos__ = __abs__ = __invert__ = __round__ = _same
    __iter__ = lambda self: iter(())  # noqa: E731
    __len__ = __index__ = __int__ = __hash__ = lambda self: 0  # noqa: E731
    __float__ = lambda self: 0.0  # noqa: E731
    __complex__ = lambda self: 0j  # noqa: E731
    __bool__ = __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = lambda self, *other: False  # noqa: E731
    __ne__ = lambda self, other: True  # noqa: E731
    __setitem__ = __delitem__ = __enter__ = __exit__ = lambda self, *args: None  # noqa: E731
    __str__ = __repr__ = lambda self: "<planned answer>"  # noqa: E731
    __format__ = lambda self, spec: "<planned answer>"  # noqa: E731


for _op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow", "lshift", "rshift", "and",
            "xor", "or"):  # fmt: skip
    for _form in ("__{}__", "__r{}__"):
        setattr(_Anything, _form.format(_op), _Anything._same)
_ANYTHING = _Anything()


class _Planning(ast.NodeTransformer):
    """The tests as the planner runs them: nothing an assert does stops them, and no operand
    is skipped, so that every call they could make for some answers is met."""

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        self.generic_visit(node)
        return [_quietly(e, node) for e in (node.test, node.msg) if e is not None]

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        self.generic_visit(node)
        helper = "__tunelab_and" if isinstance(node.op, ast.And) else "__tunelab_or"
        return _thunks(node, helper, node.values)

    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        self.generic_visit(node)
        return _thunks(node, "__tunelab_ifexp", [node.test, node.body, node.orelse])

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id in ("all", "any") and len(node.args) == 1
                and isinstance(node.args[0], ast.GeneratorExp) and not node.keywords):  # fmt: skip
            node.args[0] = ast.copy_location(ast.ListComp(node.args[0].elt, node.args[0].generators), node.args[0])
        return node


def _quietly(expr: ast.expr, where: ast.AST) -> ast.stmt:
    handler = ast.ExceptHandler(ast.Name("Exception", ast.Load()), None, [ast.Pass()])
    return ast.copy_location(ast.Try([ast.Expr(expr)], [handler], [], []), where)


def _thunks(node: ast.expr, helper: str, operands: list[ast.expr]) -> ast.expr:
    """helper(lambda: a, lambda: b, ...), unless an operand binds a name (a lambda would change its scope)."""
    if any(isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) for e in operands for n in ast.walk(e)):
        return node
    no_args = ast.arguments([], [], None, [], [], None, [])
    call = ast.Call(ast.Name(helper, ast.Load()), [ast.Lambda(no_args, e) for e in operands], [])
    return ast.copy_location(call, node)


def _eager(thunks: tuple[Callable[[], object], ...]) -> list[tuple[bool, Any]]:
    """Every operand's value, or the Exception it raised."""
    results = []
    for thunk in thunks:
        try:
            results.append((True, thunk()))
        except Exception as e:
            results.append((False, e))
    return results


def _pick(results: list[tuple[bool, Any]], stop_at_truth: bool) -> object:
    for ok, value in results:  # what the short-circuit would have given, from full results
        if not ok:
            raise value
        if bool(value) == stop_at_truth:
            return value
    return value


def _and(*thunks: Callable[[], object]) -> object:
    return _pick(_eager(thunks), False)


def _or(*thunks: Callable[[], object]) -> object:
    return _pick(_eager(thunks), True)


def _ifexp(test: Callable[[], object], body: Callable[[], object], orelse: Callable[[], object]) -> object:
    (ok, cond), *branches = _eager((test, body, orelse))
    if not ok:
        raise cond
    ok, value = branches[0] if cond else branches[1]
    if not ok:
        raise value
    return value


# --------------------------------------------------------------------------- 2. ask


def _ask(plan: list[bytes], call_fd: int, answer_fd: int, deadline: float) -> list:
    """Per planned call its answer's frame, or why there is none: "timeout", "ended",
    "garbled" (not a frame of the wire), "too large" (past MAX_ANSWER_BYTES in total)."""
    os.set_blocking(call_fd, False)
    os.set_blocking(answer_fd, False)
    answers: list = []
    kept, gone = 0, None
    for message in plan:
        frame = None
        if gone is None:
            try:
                send(call_fd, message, deadline)  # noqa: F821
                frame = receive(answer_fd, deadline)  # noqa: F821
                gone = "ended" if frame is None else None
            except TimeoutError:
                gone = "timeout"
            except BrokenPipeError:
                gone = "ended"
            except WireError:  # noqa: F821
                gone = "garbled"
        if frame is None:
            answers.append(gone)
        elif kept + len(frame) > MAX_ANSWER_BYTES:
            answers.append("too large")
        else:
            kept += len(frame)
            answers.append(frame)
    return answers


# --------------------------------------------------------------------------- 3. check
#
# The check takes as long whichever answers were right: every answer is decoded before any
# test runs, and the tests run to their end, each failure recorded rather than raised, with
# every operand evaluated as in planning. What is left of the time a verdict takes is the
# comparisons themselves: builtin `==` on decoded plain data, which runs no code of the
# program's and stops early at most within the values it compares (see docs/RELIABILITY.md).


class _Missing(BaseException):
    """A call the judge cannot answer (not asked, not answered, not an answer): recorded as a
    failure with its verdict, then raised to end the statement that made it. Not an Exception,
    so that the tests' own `except Exception` cannot swallow it (it is recorded first anyway)."""

    def __init__(self, verdict: str, why: str) -> None:
        super().__init__(why)
        self.verdict = verdict


def _prepared(job: dict, seed: int) -> tuple[dict, Any, list]:
    """The check's namespace (the context run, the randomness reset), its code (the tests as
    _Checking writes them, compiled; or the error that stopped that) and its list of failures."""
    failures: list[tuple[BaseException, Any]] = []

    def failed(e: BaseException) -> None:
        failures.append((e, sys._getframe(1)))

    namespace = _namespace(job, seed)
    namespace.update(__tunelab_and=_and, __tunelab_or=_or, __tunelab_ifexp=_ifexp, __tunelab_assertion=_assertion,
                     __tunelab_failed=failed, __tunelab_Missing=_Missing)  # fmt: skip
    try:
        tree = _Checking().visit(ast.parse(job["tests"], "tests.py"))
        code: Any = compile(ast.fix_missing_locations(tree), "tests.py", "exec")
    except BaseException as e:  # the tests do not compile: the check fails with this
        code = e
    return namespace, code, failures


def _check(job: dict, plan: list[bytes], answers: list, cut: str | None, prepared: tuple) -> str:
    namespace, code, failures = prepared
    # One budget for every answer: together they build at most COST_FACTOR x the bytes kept +
    # COST_SLACK of objects, decoded here, all of them, before any test runs.
    budget = Budget(sum(len(a) for a in answers if isinstance(a, bytes)))  # noqa: F821
    replies = [_decoded(a, budget) for a in answers]
    where: dict[bytes, list[int]] = {}
    for i, message in enumerate(plan):
        where.setdefault(message, []).append(i)
    cursor = [0]
    for name in job["calls"]:
        namespace[name] = _replay(name, where, replies, cursor, (cut, namespace["__tunelab_failed"]))
    try:
        if isinstance(code, BaseException):
            raise code
        exec(code, namespace)
    except BaseException as e:  # what no statement's recording caught (an error of the tests' own)
        failures.append((e, None))
    try:
        raise _Missing("passed", "")
    except _Missing as stand_in:  # formatted when the tests passed, so that passing costs what failing does
        first, frame = failures[0] if failures else (stand_in, sys._getframe())
    text = _formatted(first, frame)  # whatever the verdict: its time must not say which
    if not failures:
        return "passed"
    sys.stderr.write(f"{first}\n" if isinstance(first, _Missing) else text)
    return first.verdict if isinstance(first, _Missing) else "failed"


def _formatted(e: BaseException, frame: Any) -> str:
    """e's traceback as a whole-program run shows it, from the tests' outermost frame on (the frames
    above the one that recorded it included), without the judge's own frames. Written out here
    rather than by `traceback`, whose import would cost every run milliseconds; the tests' files
    have no source lines to show anyway."""
    outer: list[tuple[str, int, str]] = []
    while frame is not None:
        outer.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    inner, tb = [], e.__traceback__
    while tb is not None:
        inner.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    frames = [*reversed(outer[1:]), *inner]  # the recording frame is the traceback's first
    lines = [f'  File "{f}", line {n}, in {name}\n' for f, n, name in frames if f in ("tests.py", "context.py")]
    text = str(e)
    last = f"{type(e).__name__}: {text}\n" if text else f"{type(e).__name__}\n"
    return "Traceback (most recent call last):\n" + "".join(lines) + last


def _replay(name: str, where: dict, replies: list, cursor: list, state: tuple) -> Callable[..., object]:
    cut, failed = state

    def call(*args: object, **kwargs: object) -> object:
        key = encode((name, args, kwargs))  # noqa: F821 (a TypeError for what is not data, as before)
        places = where.get(key, [])
        k = bisect.bisect_left(places, cursor[0])
        if k == len(places):
            if cut is not None:
                _missing(failed, "failed", f"{name}() was not asked: {cut}")
            _missing(failed, "failed", f"the tests called {name}() with arguments that planning them (every call "
                                       "answered None) did not produce: their inputs depend on the program's answers, "
                                       "or on randomness other than `random`, `secrets` and os.urandom, which the "
                                       "judge replays. Asking would tell the program how its answers did, so the run "
                                       "is scored failed")  # fmt: skip
        cursor[0] = places[k] + 1
        return _reply(name, replies[places[k]], failed)

    call.__name__ = call.__qualname__ = name
    return call


def _missing(failed: Callable[[BaseException], None], verdict: str, why: str) -> None:
    e = _Missing(verdict, why)
    failed(e)
    raise e


_GONE = {
    "timeout": ("timeout", "the program did not answer {}() in time"),
    "ended": ("ended", "the program ended before answering {}()"),
    "garbled": ("failed", "the program's answers stopped being frames of the wire before {}()"),
    "too large": ("failed", f"the answer to {{}}() came after {MAX_ANSWER_BYTES} bytes of answers"),
}


def _decoded(frame: bytes | str, budget: Budget) -> tuple:  # noqa: F821
    """One answer as the check replays it: ("ok", value), ("raise", kind, text) for an exception
    the program raised, or ("gone", verdict, why) where there is no answer to give."""
    if isinstance(frame, str):
        return ("gone", *_GONE[frame])
    try:
        answer = decode(frame, budget)  # noqa: F821
    except WireError as e:  # noqa: F821
        return ("gone", "failed", "the answer to {}() is not one: " + str(e).replace("{", "{{").replace("}", "}}"))
    if type(answer) is tuple and len(answer) == 2 and answer[0] == "ok":
        return answer
    if type(answer) is tuple and len(answer) == 3 and answer[0] == "raise" and all(type(x) is str for x in answer):
        return answer
    shown = str(answer)[:80].replace("{", "{{").replace("}", "}}")
    return ("gone", "failed", "the answer to {}() is not one: " + shown)


def _reply(name: str, reply: tuple, failed: Callable[[BaseException], None]) -> object:
    if reply[0] == "ok":
        return reply[1]
    if reply[0] == "gone":
        _missing(failed, reply[1], reply[2].format(name))
    kind, text = reply[1:]
    cls = getattr(builtins, kind, None)
    error: Exception = RuntimeError(f"{name}() raised {kind}: {text}")
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:  # a builtin exception the tests may expect, e.g. ValueError
            error = cls(text)
        except Exception:  # one that takes other arguments
            pass
    raise error


def _assertion(test: Callable[[], object], message: Callable[[], object] | None = None) -> tuple[bool, object]:
    """An assert's test and message, both evaluated whatever the test's value (as planning does):
    whether it held, and its message; raises what the assert would have raised instead."""
    (ok, value), (said, text) = _eager((test, message or (lambda: None)))
    if not ok:
        raise value
    held = bool(value)
    if not held and not said:
        raise text
    return held, text


class _Checking(_Planning):
    """The tests as the check runs them: every operand evaluated as planning evaluates it (so the
    same calls and comparisons, whatever the answers), and every statement run whatever the
    statements before it did: a failed assert or an error is recorded (`__tunelab_failed`) and
    the tests go on. Inside the tests' own `try` and `with` blocks, which may expect an
    exception, statements raise as written."""

    def __init__(self) -> None:
        self.guarded = 0  # inside a try or with block of the tests'

    def visit_Assert(self, node: ast.Assert) -> ast.stmt | list[ast.stmt]:
        self.generic_visit(node)
        operands = [node.test] + ([node.msg] if node.msg is not None else [])
        binding = (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)
        if any(isinstance(n, binding) for e in operands for n in ast.walk(e)):
            return node  # a lambda would change the scope of the name it binds: evaluated as written
        no_args = ast.arguments([], [], None, [], [], None, [])
        result = ast.Name("__tunelab_assertion_result", ast.Store())
        call = ast.Call(ast.Name("__tunelab_assertion", ast.Load()), [ast.Lambda(no_args, e) for e in operands], [])
        item = [ast.Subscript(ast.Name(result.id, ast.Load()), ast.Constant(i), ast.Load()) for i in (0, 1)]
        check = ast.Assert(item[0], item[1] if node.msg is not None else None)
        return [ast.copy_location(ast.Assign([result], call), node), ast.copy_location(check, node)]

    def _body(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for statement in statements:
            visited = self.visit(statement)
            for s in visited if isinstance(visited, list) else [visited]:
                out.append(s if self.guarded or _unwrapped(s) else _recorded(s))
        return out

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = self._body(node.body)
        return node

    def _visit_function(self, node: ast.AST) -> ast.AST:
        for field in ("decorator_list", "args", "returns"):
            value = getattr(node, field, None)
            if isinstance(value, list):
                setattr(node, field, [self.visit(v) for v in value])
            elif value is not None:
                setattr(node, field, self.visit(value))
        guarded, self.guarded = self.guarded, 0  # a function's statements are recorded wherever it is defined
        node.body = self._body(node.body)
        self.guarded = guarded
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def _visit_compound(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse", "finalbody"):
                setattr(node, field, self._body(value))
            elif field == "handlers":
                for handler in value:
                    handler.type = self.visit(handler.type) if handler.type is not None else None
                    handler.body = self._body(handler.body)
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))
            elif isinstance(value, list):
                setattr(node, field, [self.visit(v) for v in value])
        return node

    visit_For = visit_AsyncFor = visit_While = visit_If = _visit_compound

    def _visit_guarded(self, node: ast.AST) -> ast.AST:
        self.guarded += 1
        try:
            return self._visit_compound(node)
        finally:
            self.guarded -= 1

    visit_Try = visit_TryStar = visit_With = visit_AsyncWith = _visit_guarded


def _unwrapped(statement: ast.stmt) -> bool:
    """Statements that cannot fail, or that a try would change: left as they are."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Global, ast.Nonlocal, ast.Pass,
                              ast.Break, ast.Continue)):  # fmt: skip
        return True
    return isinstance(statement, ast.ImportFrom) and statement.module == "__future__"


def _recorded(statement: ast.stmt) -> ast.stmt:
    """try: statement / except (Exception, _Missing) as e: __tunelab_failed(e)"""
    kinds = ast.Tuple([ast.Name("Exception", ast.Load()), ast.Name("__tunelab_Missing", ast.Load())], ast.Load())
    record = ast.Expr(ast.Call(ast.Name("__tunelab_failed", ast.Load()), [ast.Name("__tunelab_e", ast.Load())], []))
    handler = ast.ExceptHandler(kinds, "__tunelab_e", [record])
    return ast.copy_location(ast.Try([statement], [handler], [], []), statement)


if __name__ == "__main__":
    main()
