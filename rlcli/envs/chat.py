"""The token contract of a multi-turn row, and the chat template that renders the conversation.

A multi-turn row is  prompt ⊕ generated₁ ⊕ observation₁ ⊕ generated₂ ⊕ ...  where
- the prompt is the template's rendering of the environment's first messages with the generation prompt;
- each generated part is the engine's token ids, appended verbatim (up to and including EOS): never decoded and
  encoded again, since tokenising generated text back need not give the tokens that were sampled;
- each observation is exactly what the template adds after that assistant turn: render the conversation with
  and without the new messages (tool results, ...), the second with the generation prompt, and take the text
  after the assistant turn's EOS token. Template boundary text between turns (the newline after `<|im_end|>`,
  the next turn's header, the generation prompt) is part of the observation, so none is dropped or duplicated.
  The observation text starts right after a special token, where tokenisation splits anyway, so encoding it
  alone gives the tokens the whole rendering has there. Observation tokens carry response_mask 0.

A template that rewrites earlier turns when the conversation grows (one that strips the `<think>` blocks of
earlier turns, say) breaks the contract: the rows would not be what the model reads at the next turn. Such a
template is refused at start-up (`ChatFormat.check`), and every observation checks the prefix again.
"""

from __future__ import annotations

from typing import Any

PLAIN = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
    "{%- elif m['role'] == 'tool' -%}{{ '\\n' + m['content'] + '\\n' }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""For tokenizers without a chat template (the tiny model): user and system text as it is, an assistant turn
ends with EOS, a tool result is its text on its own line. `Q: 34+85=?\\nA: calc(34+85)</s>\\n119\\n\\boxed{119}</s>`"""

CHAT_TEMPLATES = {"plain": PLAIN}
"""Named templates for env.template (null: the tokenizer's own)."""

Message = dict[str, str]


class TemplateError(ValueError):
    """The chat template cannot give observation tokens under the token contract (module doc)."""


class ChatFormat:
    """Renders conversations with one chat template, and cuts observations out of them."""

    def __init__(self, tokenizer: Any, template: str | None, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.template = CHAT_TEMPLATES.get(template, template) if template else tokenizer.chat_template
        if self.template is None:
            raise TemplateError("the tokenizer has no chat template: set env.template=plain (or a Jinja template)")
        self.eos = tokenizer.eos_token
        self.check()

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, chat_template=self.template,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self.render(messages, True))

    def observation_text(self, history: list[Message], new: list[Message]) -> str:
        """What the template adds after `history` (ending with an assistant turn) for the `new` messages, up to
        the next generation prompt, from the assistant turn's EOS on."""
        before, after = self.render(history, False), self.render(history + new, True)
        if not after.startswith(before):
            raise TemplateError("the chat template renders earlier turns differently once the conversation "
                                f"grows:\n  {before[-120:]!r}\nbecomes\n  {after[: len(before)][-120:]!r}")
        end = before.rfind(self.eos)
        if end < 0:
            raise TemplateError(f"the chat template does not end an assistant turn with EOS ({self.eos!r})")
        return after[end + len(self.eos) :]

    def observation_ids(self, history: list[Message], new: list[Message]) -> list[int]:
        return self.encode(self.observation_text(history, new))

    def check(self) -> None:
        """Refuse a template that rewrites earlier turns or ends assistant turns without EOS, on a probe
        conversation of two tool rounds whose assistant turns hold `<think>` blocks."""
        history: list[Message] = [{"role": "user", "content": "What is 2+3?"}]
        for k in range(2):
            history.append({"role": "assistant", "content": f" <think>step {k}</think>calc(2+3)\n"})
            content, rendered = history[-1]["content"], self.render(history, False)
            if content not in rendered:
                raise TemplateError("the chat template does not render an assistant turn as it was generated "
                                    f"({content!r} is not in its rendering): it rewrites turns")
            if content + self.eos not in rendered:
                raise TemplateError(f"the chat template does not end an assistant turn with EOS ({self.eos!r}) right "
                                    "after its content")
            tool = [{"role": "tool", "name": "calc", "content": "5"}]
            self.observation_text(history, tool)
            history += tool
