"""The chat-template sandbox's bounds (`dflash_jax.data.template_sandbox`): a template from a model
directory that loops or allocates without limit ends in one ValueError line within the time
bound, and real templates render exactly as before (jinja2's immutable sandbox, unbounded)."""

from __future__ import annotations

import json
import time

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dflash_jax.data import prompting, template_sandbox

LIMIT_S = 0.5
MAX_CHARS = 65536
MARGIN_S = 3.0  # wall time allowed past the bound (a loaded CI machine)
MSGS = [{"role": "user", "content": "hi"}]
WHERE = "model/tokenizer_config.json"


def _refused(template, messages=MSGS, **kw):
    """(message, seconds) of the ValueError rendering `template` must raise."""
    kw = {"time_limit_s": LIMIT_S, "max_chars": MAX_CHARS, **kw}
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        prompting.render_chat(template, messages, WHERE, **kw)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert isinstance(e.value, prompting.ChatTemplateError)
    assert msg.startswith(WHERE + ": ") and "\n" not in msg, msg
    return msg, took


LOOPS = {
    "nested-range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested-string": "{% set s = 'ab' * 30000 %}{% for i in s %}{% for j in s %}{% endfor %}"
    "{% endfor %}",
    "nested-with-loop-vars": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% if loop.last %}{% endif %}{% endfor %}{% endfor %}",
    "macro-in-loop": "{% macro f(x) %}{% endmacro %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{{ f(j) }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", LOOPS)
def test_a_loop_past_the_time_bound_ends_in_one_line_within_it(name):
    msg, took = _refused(LOOPS[name])
    assert f"rendering took more than {LIMIT_S:g} s" in msg, msg
    assert LIMIT_S <= took < LIMIT_S + MARGIN_S, took


ALLOCATIONS = {
    "string-repetition": ("{{ 'x' * 10 ** 12 }}", "str * 1000000000000"),
    "list-repetition": ("{{ [1, 2] * 10 ** 9 }}", "list * 1000000000"),
    "repetition-of-a-bound-value": ("{% set s = 'x' * 60000 %}{{ s * 2 }}", "str * 2"),
    "tojson-indent": ("{{ messages | tojson(indent=10 ** 9) }}", "tojson"),
    "tojson-indent-below-the-size-bound": ("{{ messages | tojson(indent=1000) }}", "indent"),
    "lipsum": ("{{ lipsum(n=10 ** 8) }}", "lipsum"),
    "lipsum-below-the-int-bound": ("{{ lipsum(n=60000, max=100) }}", "lipsum"),
    "center": ("{{ 'x' | center(10 ** 10) }}", "center"),
    "str-method": ("{{ 'x'.ljust(10 ** 10) }}", "ljust"),
    "percent-width": ("{{ '%0999999999d' % 1 }}", "format width"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "format width"),
    "replace": ("{% set s = 'x' * 2000 %}{{ s | replace('x', s) }}", "replace"),
    "doubling-tilde": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "would have more than",
    ),
    "doubling-plus": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "the result of +",
    ),
    "shared-list-tree": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
        "{% endfor %}{{ ns.l }}",
        "would have more than",
    ),
    "join-of-copies": ("{% set s = 'x' * 1000 %}{{ ([s] * 1000) | join }}", "list * 1000"),
    "huge-power": ("{{ 10 ** (10 ** 9) }}", "bits"),
    "output": (
        "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
        "the rendered text",
    ),
}


@pytest.mark.parametrize("name", ALLOCATIONS)
def test_an_allocation_past_the_size_bound_is_refused_in_one_line(name):
    template, want = ALLOCATIONS[name]
    msg, took = _refused(template, [{"role": "user", "content": "y" * 100}])
    assert "refused to render" in msg and want in msg, msg
    assert took < LIMIT_S + MARGIN_S, took


def test_range_beyond_the_sandbox_limit_is_one_line():
    msg, _ = _refused("{{ range(1000000) | list }}")
    assert "range() of 1000000 items: more than the template limit of 100000" in msg, msg


@pytest.mark.parametrize(
    "template,want",
    [
        ("{% for %}", "TemplateSyntaxError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ range('a') }}", "range() expects integers"),
    ],
)
def test_every_other_template_failure_is_one_line(template, want):
    msg, _ = _refused(template)
    assert want in msg, msg


def test_the_environment_sets_the_bounds(monkeypatch):
    monkeypatch.setenv(template_sandbox.TIME_ENV, str(LIMIT_S))
    monkeypatch.setenv(template_sandbox.CHARS_ENV, "1000")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"rendering took more than 0\.5 s"):
        prompting.render_chat(LOOPS["nested-range"], MSGS, WHERE)
    assert time.monotonic() - t0 < LIMIT_S + MARGIN_S
    with pytest.raises(ValueError, match="size limit of 1000 "):
        prompting.render_chat("{{ 'x' * 1001 }}", MSGS, WHERE)
    assert prompting.render_chat("{{ 'x' * 1000 }}", MSGS, WHERE) == "x" * 1000
    monkeypatch.setenv(template_sandbox.TIME_ENV, "soon")
    with pytest.raises(ValueError, match="DFLASH_TEMPLATE_TIME_LIMIT='soon': expected a positive"):
        prompting.render_chat("hi", MSGS, WHERE)


def test_the_defaults_are_far_above_a_real_prompt():
    t, n = template_sandbox.limits()
    assert (t, n) == (template_sandbox.TIME_LIMIT_S, template_sandbox.MAX_CHARS)
    assert t >= 10 and n >= 1_000_000


# A Qwen2.5-style template: tools as JSON, system default, tool calls, tool responses.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {%- set ns.turns = ns.turns + 1 %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content.split('</think>')[-1].lstrip('\\n') }}
        {%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {{- '\\n<tool_call>\\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {{- tool_call.arguments | tojson(indent=2) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
{{- '%d turns, %s' % (ns.turns, "{:>4}".format(messages | length)) if false else '' }}"""

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int"}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse.  "},
    {"role": "user", "content": "déjà vu? 你好 <b>&</b>"},
    {
        "role": "assistant",
        "content": "<think>\nplan\n</think>\n\nadding",
        "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}],
    },
    {"role": "tool", "content": "3"},
    {"role": "tool", "content": "ok"},
    {"role": "user", "content": "x" * 5000},
] + [{"role": r, "content": f"turn {i}"} for i in range(200) for r in ("user", "assistant")]


def _unbounded(template, **variables):
    """What prompting rendered before the bounds: jinja2's immutable sandbox as it is."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, **kw: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, **kw
    )
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    return env.from_string(template).render(**variables)


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("gen", [True, False])
def test_a_real_template_renders_identically_within_the_bounds(tools, gen):
    variables = {"tools": tools, "bos_token": "<s>"}
    ours = prompting.render_chat(
        QWEN_TEMPLATE, CONVERSATION, WHERE, add_generation_prompt=gen, **variables
    )
    theirs = _unbounded(
        QWEN_TEMPLATE,
        messages=CONVERSATION,
        add_generation_prompt=gen,
        enable_thinking=False,
        **variables,
    )
    assert ours == theirs
    assert ("<tools>" in ours) == (tools is not None) and '"arguments": {\n  "a": 1' in ours
    # ... and within small bounds too: the bounds cost a real template nothing (the time
    # bound with the loaded machine's margin: under two busy pytest workers a render once took
    # more than 0.5 s).
    assert ours == prompting.render_chat(
        QWEN_TEMPLATE,
        CONVERSATION,
        WHERE,
        add_generation_prompt=gen,
        time_limit_s=LIMIT_S + MARGIN_S,
        max_chars=MAX_CHARS,
        **variables,
    )


def test_loop_variables_and_filters_behave_as_in_jinja2():
    template = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.revindex }}"
        "{% if loop.last %}!{% endif %}{{ loop.cycle('a', 'b') }}{% endfor %}"
        "{% for x in messages | map(attribute='role') | unique %}{{ x | upper }}{% endfor %}"
        "{% for i in range(3) recursive %}{{ i }}{% endfor %}"
        "{{ messages | selectattr('role', 'eq', 'user') | list | length }}"
        "{{ '%s-%03d' % ('a', 7) }}{{ '{}:{:>3}'.format('b', 1) }}{{ 'a,b' | replace(',', ';') }}"
        "{{ 'ab' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ messages | tojson }}{{ lipsum(1, False, 5, 6) | length > 0 }}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ours = prompting.render_chat(template, msgs, WHERE)
    theirs = _unbounded(template, messages=msgs)
    assert ours == theirs


def test_chat_template_list_form_picks_the_default(tmp_path):
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert prompting.chat_template(str(tmp_path)) == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template must be a string"):
        prompting.chat_template(str(tmp_path))
