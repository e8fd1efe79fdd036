"""Incremental detokenization with stop strings.

Decoding works on a short window of token ids: the last tokens whose text was released (at first
the prompt's last few), then the new ones from ``_read`` on. The window is decoded, and what lies
past the left context's own text is new. The left context makes tokenizers whose decode depends on
neighbours (sentencepiece leading spaces) come out right, and the window keeps the cost per token
small however long the output gets.
"""

from __future__ import annotations

# Prompt tokens kept as left context for the first output tokens (vLLM uses 5 too).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into released text, holding back what is not final yet.

    Text is held back while it (a) ends in an incomplete UTF-8 character, or (b) could still be
    the start of a stop string. ``text`` is all text released so far. Generation stops at the first
    token that completes a stop string, as in vLLM and OpenAI: ``stopped`` becomes True and the text
    is cut just before the occurrence that ends first (of those ending at the same character, the one
    starting first; just after it with ``include_stop``), and nothing more comes. Where it ends is a
    property of the text, so the cut does not depend on how the text was split into tokens.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stop = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.stopped = False
        self.stop_string = None  # the stop string that ended the text, once stopped
        self._pending = ""  # decoded, not yet released: could be the start of a stop string
        self._unchecked = 0  # how much of _pending came before stop strings were looked for (min_tokens)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        if self._decode(self._ids).endswith(_REPLACEMENT):
            # The prompt ends inside a character: its continuation belongs to neither side.
            self._ids = []
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_new(self, final: bool) -> str:
        """Text of the not-yet-decoded tokens, or "" while it ends mid-character (unless final)."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids)
        if not final and (len(new_text) <= len(self._context_text)
                          or new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(self._context_text):]
        # The tokens just decoded become the next left context; drop what is older.
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return delta

    def _release(self, delta: str, final: bool, check_stop: bool) -> str:
        buf = self._pending + delta
        if not self.stop:
            self.text += buf
            self._pending = ""
            return buf
        # vLLM's rule: an occurrence counts if it ends in text that came once stop strings are looked for, even if
        # it starts in text that came before (the first min_tokens tokens'). So that text, too, is held back
        # while it could start a stop string.
        found = [(i, s) for i, s in ((self._find(buf, s), s) for s in self.stop) if i >= 0] if check_stop else []
        if found:
            # Every occurrence ends in this step's text (one ending earlier would have stopped an earlier step),
            # and none starts in released text (that was held while it could start one): stop at the one that
            # ends first, of those ending together the one starting first.
            cut, stop_string = min(found, key=lambda f: (f[0] + len(f[1]), f[0]))
            end = cut + len(stop_string) if self.include_stop else cut
            out, self._pending, self.stopped = buf[:end], "", True
            self.stop_string = stop_string
        else:
            # Earliest position from which the rest of buf is a proper prefix of some stop string:
            # a stop string may still start there, so nothing from there on can be released yet.
            hold = len(buf)
            if not final:
                for j in range(max(0, len(buf) - self._max_stop + 1), len(buf)):
                    tail = buf[j:]
                    if any(len(s) > len(tail) and s.startswith(tail) for s in self.stop):
                        hold = j
                        break
            out, self._pending = buf[:hold], buf[hold:]
            self._unchecked = len(self._pending) if not check_stop else max(0, self._unchecked - hold)
        self.text += out
        return out

    def _find(self, buf: str, stop: str) -> int:
        """The first occurrence of stop in buf that ends past the unchecked text, or -1."""
        return buf.find(stop, max(0, self._unchecked - len(stop) + 1))

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str:
        """Append newly generated tokens; returns the newly released text (may be ""). check_stop=False (the first
        min_tokens tokens) looks for no stop string; one found later may start in that text, as in vLLM."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False, check_stop=check_stop)

    def finish(self, check_stop: bool = True) -> str:
        """Generation ended without a stop string having been confirmed: release what is held.

        If the held text contains a stop string (possible when an earlier partial match kept
        it waiting), the text is still cut there and ``stopped`` becomes True.
        """
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True, check_stop=check_stop)


class NoTextDetokenizer:
    """For models without a tokenizer (dummy weights): token ids only, no text, no stop strings."""

    text = ""
    stopped = False
    stop_string = None

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str:
        return ""

    def finish(self, check_stop: bool = True) -> str:
        return ""
