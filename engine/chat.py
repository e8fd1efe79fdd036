"""A conversation rendered by the model's chat template, as the prompt text and its token ids."""


def render_chat(tokenizer, messages, add_generation_prompt=True, **template_kwargs) -> tuple[str, list[int]]:
    """The ids are the text's tokens without the tokenizer's special tokens: the template writes its own BOS, and
    tokenizing its text as a plain prompt would add a second one (as HF's apply_chat_template(tokenize=True))."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)
    return text, tokenizer(text, add_special_tokens=False).input_ids
