"""Chat templates (jinja2, rendered as HF transformers renders them) and assistant-span tracking.

    tmpl = ChatTemplate.for_config("qwen2.5", tokenizer)
    text, spans = tmpl.render_with_spans(messages)   # spans: [(start, end)] chars of assistant output

An assistant span is found by rendering incrementally: the text added by an assistant message after the
generation prompt (`<|im_start|>assistant\\n`) — its content and end-of-turn token — is what the model learns.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dflop_jax.config import ConfigError

# Qwen2.5-Instruct's tokenizer_config.json `chat_template` (public, Apache-2.0).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# Meta-Llama-3-8B-Instruct's tokenizer_config.json `chat_template` (public, Llama 3 license).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

BUILTIN = {"qwen2.5": QWEN25_TEMPLATE, "llama3": LLAMA3_TEMPLATE}

# LLaVA `from` values -> chat roles.
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment HF transformers renders chat templates with (same options and helpers)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it references."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(
                f"chat template: jinja syntax error at line {e.lineno}: {e.message}"
            ) from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._source = source

    def __reduce__(
        self,
    ):  # compiled jinja templates do not pickle; grain workers need the processor
        return (ChatTemplate, (self._source, self._tokens["bos_token"], self._tokens["eos_token"]))

    @classmethod
    def for_config(cls, name: str, tokenizer) -> ChatTemplate:
        """`name` is "qwen2.5", "llama3", "from_tokenizer" (the tokenizer directory's template) or
        "auto", which `TrainConfig` resolves from `model.hf_dir`; left unresolved it is qwen2.5."""
        if name == "auto":
            name = "qwen2.5"
        if name == "from_tokenizer":
            if not tokenizer.chat_template:
                raise ConfigError(
                    f"data.chat_template=from_tokenizer: tokenizer {tokenizer.name} has none; use qwen2.5 or llama3"
                )
            return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        if name not in BUILTIN:
            raise ConfigError(
                f"data.chat_template={name!r}: choose auto, qwen2.5, llama3 or from_tokenizer"
            )
        return cls(BUILTIN[name], tokenizer.bos_token, tokenizer.eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens
        )

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation and the [start, end) character spans of each assistant turn's output."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            upto = self.render(messages[: i + 1])
            start = self._turn_start(messages[:i], upto)
            if not full.startswith(upto):  # templates that render the last turn differently
                start, upto = _find_content(full, message["content"], spans)
            spans.append((start, len(upto)))
        return full, spans

    def _turn_start(self, before: list[dict], upto: str) -> int:
        """Where the assistant's output begins: after the generation prompt if the template has one."""
        for prompt in (True, False):
            head = self.render(before, add_generation_prompt=prompt) if before else ""
            if upto.startswith(head):
                return len(head)
        return 0


def _find_content(full: str, content: str, spans: list[tuple[int, int]]) -> tuple[int, str]:
    after = spans[-1][1] if spans else 0
    start = full.find(content.strip(), after)
    if start < 0:
        raise ConfigError("chat template: cannot locate an assistant turn in the rendered text")
    return start, full[: start + len(content.strip())]


def to_messages(conversations: list[dict], system_prompt: str | None) -> list[dict]:
    """LLaVA `conversations` ({from, value}) -> chat messages ({role, content}); adds `system_prompt`."""
    messages = [{"role": ROLES[turn["from"]], "content": turn["value"]} for turn in conversations]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
