"""Chat records -> text segments, each marked trained (assistant replies) or not (everything else).

A conversation is rendered with the tokenizer's own chat template (tokenizer_config.json's `chat_template`,
Jinja, sandboxed as transformers renders it) or, when it has none, with DEFAULT_TEMPLATE (ChatML). The
segments come from rendering growing prefixes of the conversation: message i is what rendering messages[:i+1]
adds to rendering messages[:i]. For an assistant message, the header the template puts before a reply
(what `add_generation_prompt` adds) is split off and not trained; the reply and its end marker are.
"""

from __future__ import annotations

from functools import lru_cache

from llmcluster.data.sources import MAX_RECORD_BYTES
from llmcluster.errors import UserError

# ChatML's turn markers: a tokenizer trained here for chat data holds them as special tokens (one id each, so
# the end of a reply is a token a server can stop on; see tokenizer.make_tokenizer)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_MARKERS = (IM_START, IM_END)
DEFAULT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = {"system", "user", "assistant", "tool"}


@lru_cache(maxsize=8)
def _compile(template: str, max_bytes: int):
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Env(ImmutableSandboxedEnvironment):
        """The sandbox bounds loops (range), not sizes: one `'x' * 10**12`, `9**9**9` or a string doubled in a
        loop would allocate or compute without end. Those are refused before they run; what the template
        writes is counted in ChatRenderer._render."""
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                        and len(left) + len(right) > max_bytes:
                    raise SecurityError(f"a concatenation of more than {max_bytes:,} items")
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > max_bytes:
                        raise SecurityError(f"a repetition of more than {max_bytes:,} items")
            elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * abs(left).bit_length() > 4096:
                raise SecurityError("a power of more than 4096 bits")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            # str padding methods allocate what their argument asks for
            if isinstance(obj, str) and attr in PADDING:
                return False
            return super().is_safe_attribute(obj, attr, value)

    def raise_exception(msg):
        raise TemplateError(msg)

    env = Env(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters.pop("center", None)   # str.center under another name
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise UserError(f"chat template: {e}") from None


PADDING = {"center", "ljust", "rjust", "zfill", "expandtabs"}


class ChatRenderer:
    def __init__(self, template: str | None, bos: str | None, eos: str | None, max_bytes: int = MAX_RECORD_BYTES):
        self.template = _compile(template or DEFAULT_TEMPLATE, max_bytes)
        self.vars = {"bos_token": bos or "", "eos_token": eos or ""}
        self.max_bytes = max_bytes

    def _render(self, messages: list[dict], gen: bool, where: str) -> str:
        """The template's output, streamed and counted: more than max_bytes is refused as it is written."""
        from jinja2.exceptions import TemplateError

        out, size = [], 0
        try:
            for chunk in self.template.generate(messages=messages, add_generation_prompt=gen, **self.vars):
                size += len(chunk) if chunk.isascii() else len(chunk.encode("utf-8", "surrogatepass"))
                if size > self.max_bytes:
                    raise UserError(f"{where}: the chat template rendered more than {self.max_bytes:,} bytes "
                                    "(--max-record-bytes); refused")
                out.append(chunk)
        except TemplateError as e:
            raise UserError(f"{where}: the chat template refused the conversation ({e})") from None
        except MemoryError:   # a growth the checks above do not see (`~` joins): still one line
            raise UserError(f"{where}: the chat template ran out of memory rendering it; refused") from None
        return "".join(out)

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

    def end_of_turn(self) -> str | None:
        """What the template writes right after an assistant reply's text (ChatML: "<|im_end|>\\n"; Llama 3:
        "<|eot_id|>"): its first token is the one a server must stop on. None when the reply is not followed by
        anything, or the template changes the reply's text."""
        reply = "Reply."
        segs = self.segments([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": reply}],
                             "end of turn")
        text = next((t for t, trained in segs if trained), "")
        return (text[len(reply):] or None) if text.startswith(reply) else None
