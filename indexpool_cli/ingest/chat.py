"""Chat logs: one part per message, `[2026-03-01 10:22] Maria: text`; cite "chat.jsonl 2026-03-01 10:22 Maria".

Read: a JSON array or JSONL of messages (also {"messages": [...]}), a ChatGPT `conversations.json` export (the
branch the user last saw, from the root to `current_node`), and plain logs with one `time name: text` line per
message (continuation lines belong to the message above).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from . import IngestError, Part

_AUTHOR_KEYS = ("name", "sender", "author", "role")  # the most specific first: a person's name beats "user"
_CONTENT_KEYS = ("content", "text")
_TIME_KEYS = ("timestamp", "time", "date", "created_at", "create_time")


@dataclass(frozen=True)
class Message:
    author: str | None
    time: str | None  # as shown: "2026-03-01 10:22", "10:22", "01/03/2026 10:22"
    text: str
    heading: str | None = None  # the conversation's title, on the first message of each conversation of an export


def parse_chat(text: str) -> list[Message] | None:
    """The messages of a chat log, or None when the text is not one."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        messages = _parse_json_chat(stripped)
        if messages is not None:
            return messages
    return _parse_plain_log(stripped)


def chat_parts(messages: list[Message], name: str, source: str) -> list[Part]:
    """One part per message; the cite gives its time, or its number in the file when it has none."""
    parts = []
    for number, message in enumerate(messages, start=1):
        stamp = f"[{message.time}] " if message.time else ""
        speaker = f"{message.author}: " if message.author else ""
        heading = f"=== {message.heading} ===\n" if message.heading else ""
        where = message.time or f"#{number}"
        cite = " ".join(filter(None, (name, where, message.author)))
        parts.append(Part(f"{heading}{stamp}{speaker}{message.text}\n", source, cite, message=number))
    if not parts:
        raise IngestError(f"{name} has no messages with text")
    return parts


def format_time(value: object) -> str | None:
    """ISO strings trimmed to the minute (as written, no time-zone change); epoch seconds or milliseconds as UTC."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", value):
        value = float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = value / 1000 if value > 1e11 else value  # past the year 5138 in seconds: milliseconds
            return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M")
        except (OverflowError, OSError, ValueError):  # out of datetime's range, NaN, an int too big for a float
            return None
    if isinstance(value, str) and value.strip():
        iso = re.match(r"\s*(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}:\d{2}))?", value)
        if iso:
            return " ".join(filter(None, iso.groups()))
        return value.strip()[:40]
    return None


# What json.loads raises on text that is not JSON it can hold: bad syntax (JSONDecodeError, a ValueError), an
# integer of thousands of digits (ValueError), nesting deeper than the interpreter's stack (RecursionError).
_NOT_JSON = (ValueError, RecursionError)


def _parse_json_chat(text: str) -> list[Message] | None:
    try:
        value = json.loads(text)
    except _NOT_JSON:
        value = []
        for line in text.splitlines():
            if line.strip():
                try:
                    value.append(json.loads(line))
                except _NOT_JSON:
                    return None
    if isinstance(value, dict):
        value = value.get("messages") if "messages" in value else [value]
    if not isinstance(value, list) or not value or not all(isinstance(item, dict) for item in value):
        return None
    if all("mapping" in item for item in value):
        return _chatgpt_export(value)
    messages = [_json_message(item) for item in value]
    if any(message is None for message in messages):
        return None
    return [message for message in messages if message.text]


def _json_message(item: dict) -> Message | None:
    """A message, or None when `item` has no author or no content field (then the JSON is not a chat)."""
    author = next((item[key] for key in _AUTHOR_KEYS if item.get(key)), None)
    if isinstance(author, dict):  # {"role": "user", "name": "Maria"}
        author = author.get("name") or author.get("role")
    content_key = next((key for key in _CONTENT_KEYS if key in item), None)
    if not isinstance(author, str) or content_key is None:
        return None
    content = _content_text(item[content_key])
    if content is None:
        return None
    time = next((format_time(item[key]) for key in _TIME_KEYS if item.get(key) is not None), None)
    return Message(author.strip(), time, content.strip())


def _content_text(content: object, nested: bool = False) -> str | None:
    """A string, a list of strings and {"type": "text", "text": ...} parts (other parts, e.g. images, left out),
    or {"parts": [...]} (one level: a dict inside it is not text); None for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return None if nested else _content_text(content.get("parts", content.get("text")), nested=True)
    if isinstance(content, list):
        texts = []
        for piece in content:
            if isinstance(piece, str):
                texts.append(piece)
            elif isinstance(piece, dict) and isinstance(piece.get("text"), str):
                texts.append(piece["text"])
        return "\n".join(texts)
    return None


def _fields(value: object) -> dict:
    """`value` when it is a JSON object, else {}: an export of the wrong shape reads as one without those fields."""
    return value if isinstance(value, dict) else {}


def _string(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _chatgpt_export(conversations: list[dict]) -> list[Message]:
    messages = []
    for number, conversation in enumerate(conversations, start=1):
        mapping = {node_id: _fields(node) for node_id, node in _fields(conversation.get("mapping")).items()}
        heading = _string(conversation.get("title")) or f"Conversation {number}"
        first = len(messages)
        for node in _current_branch(mapping, _string(conversation.get("current_node"))):
            message = _fields(node.get("message"))
            text = (_content_text(message.get("content")) or "").strip()
            if not text:  # hidden system prompts, tool calls without text, images
                continue
            role = _string(_fields(message.get("author")).get("role"))
            messages.append(Message(role, format_time(message.get("create_time")), text))
        if len(messages) > first:
            messages[first] = Message(messages[first].author, messages[first].time, messages[first].text, heading)
    return messages


def _current_branch(mapping: dict, current: str | None) -> list[dict]:
    """The nodes from the root to `current_node`, the branch the user last saw; without one, the newest reply is
    followed at each step. `seen` guards both walks: a malformed export could loop."""
    seen: set[str] = set()
    if current not in mapping:
        current = next((node_id for node_id, node in mapping.items() if _parent(node) not in mapping), None)
        while current is not None and current not in seen:
            seen.add(current)
            children = mapping[current].get("children")
            children = [child for child in children if _string(child) in mapping] if isinstance(children, list) else []
            if not children:
                break
            current = children[-1]
        seen.clear()
    branch: list[dict] = []
    while current in mapping and current not in seen:
        seen.add(current)
        branch.append(mapping[current])
        current = _parent(mapping[current])
    return branch[::-1]


def _parent(node: dict) -> str | None:
    return _string(node.get("parent"))


# One line starts each message; the name may not hold a colon, so "Maria: a: b" is Maria saying "a: b". A line
# with a time and no name (WhatsApp's "Messages are end-to-end encrypted") is a message without an author.
_NAME_AND_TEXT = r"\s*(?:-\s+)?(?:(?P<author>[^:\n]{1,60}?):(?: |$))?(?P<text>.*)"
_LOG_LINES = (
    # 2026-03-01 10:22 - Maria: text   (also "2026-03-01T10:22:05 Maria: text")
    re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})[ T](?P<clock>\d{1,2}:\d{2})(?::\d{2})?" + _NAME_AND_TEXT),
    # [10:22] Maria: text   or   [2026-03-01 10:22] Maria: text
    re.compile(r"\[(?:(?P<date>\d{4}-\d{2}-\d{2})[ T])?(?P<clock>\d{1,2}:\d{2})(?::\d{2})?\]" + _NAME_AND_TEXT),
    # WhatsApp: 01/03/2026, 10:22 - Maria: text   or   [01/03/26, 10:22:05 PM] Maria: text. The date is kept as
    # written: whether it is day or month first depends on the phone's locale.
    re.compile(r"\[?(?P<date>\d{1,2}[/.]\d{1,2}[/.]\d{2,4}),?\s+(?P<clock>\d{1,2}:\d{2})(?::\d{2})?"
               r"(?P<ampm>\s?[AaPp]\.?[Mm]\.?)?\]?" + _NAME_AND_TEXT),
)


def _parse_plain_log(text: str) -> list[Message] | None:
    """Messages of a plain log whose first line starts a message and which has at least two messages.

    The pattern of the first line is used for the whole file, so a stray date of another form starts nothing.
    """
    lines = text.splitlines()
    pattern = next((p for p in _LOG_LINES if p.fullmatch(lines[0])), None) if lines else None
    found: list[tuple[str | None, str, list[str]]] = []  # (author, time, lines)
    for line in lines:
        match = pattern.fullmatch(line) if pattern else None
        if match and (match["author"] or match["text"]):
            fields = match.groupdict()
            clock = fields["clock"] + (" " + fields["ampm"].strip() if fields.get("ampm") else "")
            time = f"{fields['date']} {clock}" if fields["date"] else clock
            author = fields["author"].strip() if fields["author"] else None
            found.append((author, time, [fields["text"]]))
        elif found:
            found[-1][2].append(line)
        else:
            return None
    if len(found) < 2:
        return None
    messages = [Message(author, time, "\n".join(body).strip()) for author, time, body in found]
    return [message for message in messages if message.text]
