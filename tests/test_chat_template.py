"""Chat rendering must equal transformers' apply_chat_template(..., tokenize=False) character for character."""

import copy

import jinja2
import pytest

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
    with pytest.raises(jinja2.exceptions.TemplateError, match="a system message is required"):
        ours.render_chat(CONVERSATIONS["single user turn"])


def test_template_is_sandboxed(default_tokenizer):
    ours = copy.copy(default_tokenizer)
    ours.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.render_chat(CONVERSATIONS["single user turn"])
