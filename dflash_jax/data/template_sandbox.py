"""The sandbox chat templates are rendered in: jinja2's immutable sandbox (as transformers uses:
no attribute starting with "_", no mutation of lists or dicts), plus a time bound and a size
bound, because a model directory's `tokenizer_config.json` is untrusted input.

    text = render(template, {"messages": [...], ...})   # TemplateLimitError past a bound

Bounds (defaults that no real chat template comes near; the environment overrides them):

  time   TIME_LIMIT_S = 10 s of rendering (DFLASH_TEMPLATE_TIME_LIMIT, seconds). Checked on
         every loop iteration, call, filter, operator, attribute or item access and output
         chunk, so nested `range(100000)` loops end within the bound.
  size   MAX_CHARS = 4,000,000 characters (DFLASH_TEMPLATE_MAX_CHARS), about 8x the text of a
         128K-token context: the output, and every value a template builds (a string, or a
         list/dict counted element by element). Operations that multiply sizes are refused
         before they run: `'x' * N`, `[..] * N`, an integer argument above the bound
         (`center(N)`, `lipsum(n=N)`, ...), a width in a format string, `replace` whose result
         would exceed it, `tojson(indent=N)` with N above 64, `lipsum` beyond the bound, and
         integers beyond 4096 bits (`10 ** 10 ** 9`).
  range  `range()` of more than 100,000 items (jinja2's own sandbox limit) is an error too.

Every failure is a `TemplateLimitError` (a jinja2 `TemplateError`); `prompting.render_chat`
turns it and every other template failure into one `ValueError` line naming the model
directory's file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from typing import Optional

import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

TIME_LIMIT_S = 10.0
MAX_CHARS = 4_000_000
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE
MAX_INT_BITS = 4096
MAX_JSON_INDENT = 64
TIME_ENV = "DFLASH_TEMPLATE_TIME_LIMIT"
CHARS_ENV = "DFLASH_TEMPLATE_MAX_CHARS"

_CHECK_EVERY = 64  # loop iterations between clock reads
_LOOP = "_dflash_bounded_loop"
_VALUE = "_dflash_bounded_value"
_DIGITS = re.compile(r"\d+")


class TemplateLimitError(TemplateError):
    """A chat template ran past the time bound or built a value past the size bound."""


def limits(time_limit_s: Optional[float] = None, max_chars: Optional[int] = None):
    """(seconds, characters): the arguments, else the environment variables, else the
    defaults. A bad environment value is a ValueError naming the variable."""

    def env(name, kind, default):
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"{name}={raw!r}: expected a positive {kind.__name__}") from None
        return value

    t = env(TIME_ENV, float, TIME_LIMIT_S) if time_limit_s is None else float(time_limit_s)
    n = env(CHARS_ENV, int, MAX_CHARS) if max_chars is None else int(max_chars)
    if not (t > 0 and n > 0):
        raise ValueError(f"template bounds must be positive, got {t} s and {n} characters")
    return t, n


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """`ImmutableSandboxedEnvironment` with the deadline and size checks of this module. One
    environment per render (`render`); `start()` sets the clock."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, time_limit_s: float, max_chars: int, **kw):
        super().__init__(**kw)
        self.time_limit_s = time_limit_s
        self.max_chars = max_chars
        self._deadline = None
        self._ticks = 0

    # ------------------------------------------------------------------- the bounds
    def start(self):
        self._deadline = time.monotonic() + self.time_limit_s

    def tick(self):
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TemplateLimitError(
                f"rendering took more than {self.time_limit_s:g} s (the template time "
                f"limit; {TIME_ENV} sets it)"
            )

    def too_big(self, what: str, n: Optional[int]) -> TemplateLimitError:
        amount = f"{n} characters or elements, more than" if n is not None else "more than"
        return TemplateLimitError(
            f"{what} would have {amount} the template size limit of {self.max_chars} "
            f"characters or elements ({CHARS_ENV} sets it)"
        )

    def size(self, value, stop: Optional[int] = None) -> int:
        """Characters and elements of `value`, counted as its text would be (a list holding
        one string twice counts it twice); stops counting past `stop` (default the bound)."""
        stop = self.max_chars if stop is None else stop
        total, todo = 0, [value]
        while todo and total <= stop:
            x = todo.pop()
            if isinstance(x, (str, bytes)):
                total += max(len(x), 1)
            elif isinstance(x, (list, tuple, set, frozenset, dict)):
                items = (*x.keys(), *x.values()) if isinstance(x, dict) else x
                total += 1
                if total + len(items) > stop:
                    return total + len(items)
                todo.extend(items)
            elif isinstance(x, Namespace):
                todo.append(object.__getattribute__(x, "_Namespace__attrs"))
            elif isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 64:
                total += x.bit_length() // 3
            else:
                total += 1
        return total

    def check_value(self, value, what: str = "a value"):
        self.tick()
        n = self.size(value)
        if n > self.max_chars:
            raise self.too_big(what, None)
        return value

    def check_args(self, what: str, args, kwargs, ints: bool = True):
        """Before a call: inputs within the bound, no integer argument beyond it."""
        self.tick()
        values = list(args) + list(kwargs.values())
        for v in values if ints else ():
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_chars:
                shown = v if v.bit_length() < 64 else f"of {v.bit_length()} bits"
                raise TemplateLimitError(
                    f"{what}: argument {shown} exceeds the template size limit of "
                    f"{self.max_chars} ({CHARS_ENV} sets it)"
                )
        if self.size(values) > self.max_chars:
            raise self.too_big(f"the input of {what}", None)

    def check_format(self, what: str, fmt):
        """A format string whose widths or precisions exceed the bound is refused."""
        if isinstance(fmt, str):
            for m in _DIGITS.finditer(fmt):
                d = m.group()
                if len(d) > 12 or int(d) > self.max_chars:
                    raise TemplateLimitError(
                        f"{what}: format width {d[:20]} exceeds the template size limit of "
                        f"{self.max_chars} ({CHARS_ENV} sets it)"
                    )

    def check_replace(self, what, s, old, new, count=-1):
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            n = len(s) + 1 if not old else len(s) // len(old)
            if isinstance(count, int) and count >= 0:
                n = min(n, count)
            est = len(s) + n * max(len(new) - len(old), 0)
            if est > self.max_chars:
                raise self.too_big(f"the result of {what}", est)

    def check_int(self, what, bits):
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(
                f"{what}: the result would have about {bits} bits, beyond the template "
                f"limit of {MAX_INT_BITS}"
            )

    # ------------------------------------------------------------------- the hooks
    def call_binop(self, context, operator, left, right):
        self.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
                    est = self.size(seq) * max(n, 0)
                    if est > self.max_chars:
                        raise self.too_big(f"{type(seq).__name__} * {n}", est)
            if isinstance(left, int) and isinstance(right, int):
                self.check_int("*", left.bit_length() + right.bit_length())
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                self.check_int("**", max(left.bit_length() - 1, 1) * right)
        elif operator == "+":
            if self.size(left) + self.size(right) > self.max_chars:
                raise self.too_big("the result of +", None)
        elif operator == "%" and isinstance(left, str):
            self.check_format("%", left)
            self.check_args("%", (right,), {})
        return self.check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        target = getattr(__obj, "__wrapped__", __obj)
        macro = isinstance(target, Macro)  # the template's own code: its loops are bounded
        name = getattr(target, "name" if macro else "__name__", None) or "a function"
        owner = getattr(target, "__self__", None)
        what = f"{name}()"
        inputs = args if owner is None else args + (owner,)
        ints = not (macro or getattr(target, "checks_itself", False))
        __self.check_args(what, inputs, kwargs, ints=ints)
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                __self.check_format(what, owner)
            elif name == "replace":
                __self.check_replace(what, owner, *args, **kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return __self.check_value(result, f"the result of {what}")

    def getattr(self, obj, attribute):
        self._ticks += 1
        if self._ticks % _CHECK_EVERY == 0:
            self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._ticks += 1
        if self._ticks % _CHECK_EVERY == 0:
            self.tick()
        return super().getitem(obj, argument)

    # ------------------------------------------------------------------- loops, values
    def bounded_loop(self, iterable):
        return _BoundedIterable(self, iterable)

    def bound(self, ast: nodes.Template) -> nodes.Template:
        """The parsed template with every loop's iterable wrapped in the deadline check and
        every output, `~` operand and comparison operand in the size check."""

        def wrap(node, name):
            if isinstance(node, nodes.TemplateData):
                return node
            return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

        for loop in ast.find_all(nodes.For):
            loop.iter = wrap(loop.iter, _LOOP)
        for out in ast.find_all(nodes.Output):
            out.nodes = [wrap(n, _VALUE) for n in out.nodes]
        for cat in ast.find_all(nodes.Concat):
            cat.nodes = [wrap(n, _VALUE) for n in cat.nodes]
        for cmp in ast.find_all(nodes.Compare):
            cmp.expr = wrap(cmp.expr, _VALUE)
            for op in cmp.ops:
                op.expr = wrap(op.expr, _VALUE)
        ast.set_environment(self)
        return ast


class _BoundedIterable:
    """An iterable that checks the deadline as it is iterated (keeps `len` for `loop.length`)."""

    def __init__(self, env: BoundedSandbox, iterable):
        self.env, self.iterable = env, iterable

    def __len__(self):
        return len(self.iterable)

    def __iter__(self):
        env = self.env
        env.tick()
        for i, x in enumerate(self.iterable):
            if i % _CHECK_EVERY == 0:
                env.tick()
            yield x


def _guard_filter(env: BoundedSandbox, name: str, f):
    @functools.wraps(f)
    def guarded(*args, **kwargs):
        env.check_args(f"filter {name!r}", args, kwargs)
        own = args[1:] if _passes(f) else args  # without the context jinja2 passes first
        if name == "format" and own:
            env.check_format(f"filter {name!r}", own[0])
        if name == "replace":
            env.check_replace(f"filter {name!r}", *own, **kwargs)
        return env.check_value(f(*args, **kwargs), f"the result of filter {name!r}")

    return guarded


def _passes(f) -> bool:
    return getattr(f, "jinja_pass_arg", None) is not None


def make_env(time_limit_s: Optional[float] = None, max_chars: Optional[int] = None):
    """The environment chat templates are rendered in, as transformers renders them (loop
    controls, `raise_exception`, `strftime_now`, `tojson` without HTML escaping), with the
    bounds of this module. Nothing else is exposed."""
    import datetime

    t, n = limits(time_limit_s, max_chars)
    env = BoundedSandbox(
        t, n, trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if isinstance(indent, int) and not isinstance(indent, bool) and indent > MAX_JSON_INDENT:
            raise TemplateLimitError(f"tojson: indent {indent} is above {MAX_JSON_INDENT}")
        if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT:
            raise TemplateLimitError(f"tojson: indent of {len(indent)} characters")
        enc = json.JSONEncoder(
            ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        if indent is None:
            return enc.encode(x)  # no indent: at most a few times the input's size
        parts, total = [], 0
        for chunk in enc.iterencode(x):
            total += len(chunk)
            if total > env.max_chars:
                raise env.too_big("tojson's output", None)
            parts.append(chunk)
        return "".join(parts)

    def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja2's names
        for v in (n, min, max):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TemplateLimitError(f"lipsum: expected non-negative integers, got {v!r}")
        if n * max * 16 > env.max_chars:
            raise env.too_big(f"lipsum(n={n}, max={max})", n * max * 16)
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    def bounded_range(*args):
        for a in args:
            if not isinstance(a, int):
                raise TemplateError(f"range() expects integers, got {a!r}")
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateLimitError(
                f"range() of {len(r)} items: more than the template limit of {MAX_RANGE}"
            )
        return r

    bounded_range.checks_itself = True  # its own limit, with a clearer message
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["lipsum"] = lipsum
    env.globals["range"] = bounded_range
    env.filters = {k: _guard_filter(env, k, f) for k, f in env.filters.items()}
    env.filters[_LOOP] = env.bounded_loop
    env.filters[_VALUE] = env.check_value
    return env


def render(
    template: str,
    variables: dict,
    time_limit_s: Optional[float] = None,
    max_chars: Optional[int] = None,
) -> str:
    """`template` rendered with `variables` in a fresh `make_env` environment, within the
    bounds. Raises jinja2 errors (`TemplateLimitError` past a bound) and whatever the
    template's operations raise; `prompting.render_chat` turns them into one line."""
    env = make_env(time_limit_s, max_chars)
    env.start()
    compiled = env.from_string(env.bound(env.parse(template)))
    out: list = []
    total = 0
    for chunk in compiled.generate(**variables):
        total += len(chunk)
        if total > env.max_chars:
            raise env.too_big("the rendered text", None)
        env.tick()
        out.append(chunk)
    return "".join(out)
