"""Turning an environment's observation into the tokens that follow an action, tokenised once.

With a chat template, the observation becomes a new chat turn exactly as the template would write
it after an assistant message, and ends with the generation prompt of the next assistant turn.
The glue is derived from the template itself: render a probe conversation with and without the
new turn and take the difference. If the action ended with a special token that the template
writes after the assistant's content (ChatML's `<|im_end|>`), that token is already in the
trace and is not repeated; an action cut by a length cap gets the template's closing text.
Without a template the observation's text is appended as it is.
"""

from typing import Any

PROBE_USER = "\x00probe-user\x00"
PROBE_ACTION = "\x00probe-action\x00"


class ObservationFormatter:
    """Observation (text or a chat message) → token ids that continue the trace after an action."""

    def __init__(self, tokenizer: Any, apply_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        if self.apply_chat_template:
            self._probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ACTION}]
            self._probe_text = self._render(self._probe, generation_prompt=False)
            at = self._probe_text.rindex(PROBE_ACTION) + len(PROBE_ACTION)
            self.close_turn = self._probe_text[at:]
            """What the template writes after an assistant's content (e.g. `<|im_end|>\\n`)."""

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def text(self, observation: str | dict[str, Any], last_action_token: int | None) -> str:
        """The text to append after an action whose last token is `last_action_token`."""
        if not self.apply_chat_template:
            return observation if isinstance(observation, str) else str(observation.get("content", ""))
        message = {"role": "user", "content": observation} if isinstance(observation, str) else observation
        full = self._render([*self._probe, message], generation_prompt=True)
        if not full.startswith(self._probe_text):
            raise ValueError("the chat template rewrites earlier turns; multi-turn observations cannot be appended")
        closing = self.close_turn
        if last_action_token is not None:
            ended_with = self.tokenizer.convert_ids_to_tokens(last_action_token)
            special = last_action_token in self.tokenizer.all_special_ids or ended_with in self._added_specials()
            if special and closing.startswith(ended_with):
                closing = closing[len(ended_with) :]
        return closing + full[len(self._probe_text) :]

    def _added_specials(self) -> set[str]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return {tok.content for tok in added.values() if getattr(tok, "special", False)}

    def token_ids(self, observation: str | dict[str, Any], last_action_token: int | None) -> list[int]:
        return list(self.tokenizer(self.text(observation, last_action_token), add_special_tokens=False)["input_ids"])
