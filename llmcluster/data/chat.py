"""Chat records -> text segments, each marked trained (assistant replies) or not (everything else).

A conversation is rendered with the tokenizer's own chat template (tokenizer_config.json's `chat_template`,
Jinja, sandboxed as transformers renders it) or, when it has none, with DEFAULT_TEMPLATE (ChatML). The
segments come from rendering growing prefixes of the conversation: message i is what rendering messages[:i+1]
adds to rendering messages[:i]. For an assistant message, the header the template puts before a reply
(what `add_generation_prompt` adds) is split off and not trained; the reply and its end marker are.
"""

from __future__ import annotations

from functools import lru_cache

from llmcluster.errors import UserError

DEFAULT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = {"system", "user", "assistant", "tool"}


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise UserError(f"chat template: {e}") from None


class ChatRenderer:
    def __init__(self, template: str | None, bos: str | None, eos: str | None):
        self.template = _compile(template or DEFAULT_TEMPLATE)
        self.vars = {"bos_token": bos or "", "eos_token": eos or ""}

    def _render(self, messages: list[dict], gen: bool, where: str) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=gen, **self.vars)
        except TemplateError as e:
            raise UserError(f"{where}: the chat template refused the conversation ({e})") from None

    def segments(self, messages, where: str) -> list[tuple[str, bool]]:
        """[(text, trained)] whose concatenation is the whole rendered conversation."""
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: every message needs a role ({', '.join(sorted(ROLES))}) and a "
                                f"text content, got {str(m)[:80]!r}")
        out: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            full = self._render(messages[: i + 1], False, where)
            if not full.startswith(done):
                raise UserError(f"{where}: the chat template does not render a conversation as the sum of its "
                                "messages (a longer conversation changes earlier text); cannot mask it")
            if m["role"] == "assistant":
                header = self._render(messages[:i], True, where) if i else ""
                if header.startswith(done) and full.startswith(header):
                    out.append((header[len(done):], False))
                    done = header
                out.append((full[len(done):], True))
            else:
                out.append((full[len(done):], False))
            done = full
        return [(t, trained) for t, trained in out if t]
