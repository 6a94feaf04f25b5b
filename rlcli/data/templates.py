"""Prompt templates: how a problem becomes the text the policy continues.

Two independent steps, both set in the `data` group:
  1. `data.template` wraps the problem text: a named template from TEMPLATES, or a literal text
     containing `{question}`. Substitution is a plain replace, never `str.format`, so the braces of
     LaTeX problems and of `\\boxed{}` instructions are safe.
  2. `data.chat` decides whether the tokenizer's chat template turns the messages into the final
     string (`apply_chat_template(..., add_generation_prompt=True, tokenize=False)`). Without it the
     prompt is the (templated) text itself.

A chat-message prompt (DAPO-Math-17k stores `[{"role": "user", "content": ...}]`) gets the template
applied to its last user message. Rendered without a chat template, a single message is its
content, and several messages (say system + user) are joined by blank lines: roles are lost then,
so give such data a model with a chat template.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, str]]
"""A problem as an adapter returns it: plain text, or chat messages `{"role", "content"}`."""

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""DAPO's instruction (Yu et al. 2025), exactly as DAPO-Math-17k's prompts carry it; pairs with a
reward that reads the last `Answer:` line."""

TEMPLATES: dict[str, str] = {
    "question": "{question}",
    "dapo": DAPO_TEMPLATE,
    # The common chain-of-thought instruction for \boxed{} answers (Qwen2.5-Math style evaluations).
    "boxed": "{question}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    # reasoning-gym's convention (its SYSTEM_PROMPTS, read by reasoning_gym.utils.extract_answer): the final answer
    # alone between <answer> tags; the reward `reasoning_gym` reads the last such pair.
    "answer_tag": "{question}\n\nThink step by step, then give your final answer between <answer> and </answer> "
                  "tags, with nothing else inside them.",
}
"""Named templates for `data.template`; `{question}` marks where the problem goes."""

PLACEHOLDER = "{question}"


def check_template(template: str) -> None:
    """Raise a config error unless `template` is a TEMPLATES name or a text with `{question}`."""
    if template not in TEMPLATES and PLACEHOLDER not in template:
        from rlcli.core.schema import ConfigError

        raise ConfigError(
            f"data.template={template!r} is neither a named template ({', '.join(sorted(TEMPLATES))}) "
            f"nor a literal text containing {PLACEHOLDER}"
        )


def template_text(template: str) -> str:
    check_template(template)
    return TEMPLATES.get(template, template)


def fill(template: str, question: str) -> str:
    """`template` (a name or a literal) with the problem in place of `{question}`."""
    return template_text(template).replace(PLACEHOLDER, question)


def unwrap(template: str, text: str) -> str | None:
    """The problem inside `text` if `text` is exactly `template` filled in, else None."""
    prefix, _, suffix = template_text(template).partition(PLACEHOLDER)
    if len(text) >= len(prefix) + len(suffix) and text.startswith(prefix) and text.endswith(suffix):
        return text[len(prefix) : len(text) - len(suffix)]
    return None


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def use_chat_template(chat: str, tokenizer: Any) -> bool:
    """Resolve `data.chat` (auto | always | never) for this tokenizer; `always` without one fails."""
    if chat == "never":
        return False
    if chat == "always" and not has_chat_template(tokenizer):
        what = "no tokenizer was given" if tokenizer is None else "the tokenizer has no chat_template"
        raise ValueError(
            f"data.chat=always but {what}: use a chat model's tokenizer, or set data.chat=auto|never"
        )
    return has_chat_template(tokenizer)


def last_user_index(messages: list[dict[str, str]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    raise ValueError("chat-message prompt has no user message")


def apply_template(prompt: Prompt, template: str) -> list[dict[str, str]]:
    """Messages with `template` applied to the (last) user turn; a text prompt becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": fill(template, prompt)}]
    messages = [dict(m) for m in prompt]
    i = last_user_index(messages)
    messages[i]["content"] = fill(template, messages[i]["content"])
    return messages


def render_prompt(prompt: Prompt, template: str, chat: bool, tokenizer: Any = None) -> str:
    """The final prompt string: template, then the tokenizer's chat template if `chat` is true."""
    messages = apply_template(prompt, template)
    if chat:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages)
