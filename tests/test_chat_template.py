"""Chat rendering must equal transformers' apply_chat_template(..., tokenize=False) character for character."""

import copy
import resource
import time

import pytest

from indexpool.model import tokenizer
from indexpool.model.errors import InputError

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "single user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "with system": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now backwards."},
    ],
    "multi-turn without system": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Bye"},
    ],
    "ends with assistant": [{"role": "user", "content": "Say ok"}, {"role": "assistant", "content": "ok"}],
    "unicode": [
        {"role": "system", "content": "Réponds en français 🇫🇷"},
        {"role": "user", "content": "中文 日本語 한국어 😀👍🏽 \U00020000 e\u0301\n\tnew line  and  spaces"},
    ],
    "markup-like content": [{"role": "user", "content": "{{ not a variable }} {% raw %} <|im_end|> \"quotes\" \\n"}],
    "empty content": [{"role": "user", "content": ""}],
}

# Templates exercising what transformers' environment adds to plain Jinja.
CUSTOM_TEMPLATES = {
    "tojson keeps non-ASCII and HTML characters": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    "tojson options": "{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    "loop controls": "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}{{ m.content }}|{% endfor %}",
    "generation tag": "{% for m in messages %}{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}\n{% endfor %}",
    "special token variables": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ unk_token }}{{ pad_token }}",
    "tools and documents are none": "{{ tools is none }} {{ documents is none }} {{ tools is defined }}",
    "whitespace control": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n  <{{ m.content }}>\n    {% endif %}\n{% endfor %}\n"
        "{%- if add_generation_prompt %} GO{% endif %}"
    ),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_render_matches_transformers(default_tokenizer, reference_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert default_tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", ["single user turn", "multi-turn", "unicode", "markup-like content"])
def test_encode_chat_matches_transformers(default_tokenizer, reference_tokenizer, name):
    messages = CONVERSATIONS[name]
    expected = reference_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert default_tokenizer.encode_chat(messages) == expected


@pytest.mark.parametrize("name", list(CUSTOM_TEMPLATES))
def test_custom_template_matches_transformers(default_tokenizer, reference_tokenizer, name):
    template = CUSTOM_TEMPLATES[name]
    messages = CONVERSATIONS["unicode"] + [
        {"role": "assistant", "content": "<b>&'ok'</b>"},
        {"role": "user", "content": "x"},
    ]
    ours = copy.copy(default_tokenizer)
    ours.chat_template = template
    expected = reference_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours.render_chat(messages) == expected


def test_raise_exception(default_tokenizer):
    ours = copy.copy(default_tokenizer)
    ours.chat_template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message is required') }}{% endif %}"
    )
    with pytest.raises(InputError, match="the model's chat template failed: a system message is required"):
        ours.render_chat(CONVERSATIONS["single user turn"])


def test_template_is_sandboxed(default_tokenizer):
    ours = copy.copy(default_tokenizer)
    ours.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InputError, match="the model's chat template was stopped"):
        ours.render_chat(CONVERSATIONS["single user turn"])


HOSTILE_TEMPLATES = {
    "a string repeated": "{{ 'x' * 10000000000 }}",
    "a count first": "{{ 10000000000 * 'x' }}",
    "a list repeated": "{{ ([1] * 100000000) | length }}",
    "a string doubled in a loop": ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(60) %}"
                                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"),
    "a string added to itself": ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(60) %}"
                                 "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}"),
    "a huge power": "{{ 10 ** 100000000 }}",
    "a format width": "{{ '%0999999999d' % 1 }}",
    "a format method width": "{{ '{:>999999999}'.format(1) }}",
    "a string method count": "{{ 'x'.ljust(10000000000) }}",
    "a filter count": "{{ 'x' | center(10000000000) }}",
    "a range too long": "{% for i in range(10000000000) %}{% endfor %}",
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
                     "{% endfor %}{% endfor %}{% endfor %}"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_template_is_stopped_in_bounded_time_and_memory(default_tokenizer, name, monkeypatch):
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.5)
    ours = copy.copy(default_tokenizer)
    ours.chat_template = HOSTILE_TEMPLATES[name]
    start, peak = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InputError, match="the model's chat template (was stopped|failed)"):
        ours.render_chat(CONVERSATIONS["single user turn"])
    assert time.monotonic() - start < 30  # stopped at 0.5 s; the margin is for a loaded machine
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024 < 3 << 30
