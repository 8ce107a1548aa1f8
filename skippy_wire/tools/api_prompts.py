"""A request's prompts as tokens, for ``skippy-wire api``: a chat's ``messages`` through the
model's chat template, a completion's ``prompt`` (a text, token ids, llama-server's mix of
both, or a batch of them), each refused unread when it cannot fit the context."""

from __future__ import annotations

import functools
from typing import Callable, Optional

from ..stage.chat import ChatTemplate, ChatTemplateError, MalformedMessages
from .api_params import (INVALID_TYPE, MAX_PROMPTS, MESSAGES_CODES, BadRequest, check_context, check_text_fits,
                         check_token_ids, parse_template_options)


class PromptReader:
    """Reads the prompts of requests to ``engine`` (a GenerationEngine: its tokenizer and
    context) and its model's ``chat_template`` (None: chat refused, saying why: ``template_problem``,
    the reason it failed to load, or that the model has none)."""

    def __init__(self, engine, chat_template: Optional[ChatTemplate], model_id: str, template_problem: str = "") -> None:
        self.engine, self.chat_template, self.model_id = engine, chat_template, model_id
        self.template_problem = template_problem or "has no chat template"

    def check_messages_fit(self, body: dict) -> None:
        """Refuse, unrendered, ``messages`` that cannot fit the context: more messages than it
        holds tokens (a template gives each a token at least), or more text in them than those
        tokens can stand for.  Run on the event loop, before the request waits for the one
        rendering thread: 280,000 empty messages took it 3 s to render and refuse."""
        messages, ctx = body.get("messages"), self.engine.ctx_size
        if not isinstance(messages, list):
            return  # (the renderer names what is wrong with it)
        if len(messages) > ctx:
            raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, 'messages' holds "
                             f"{len(messages)} messages, a token each at least. Please reduce the number of "
                             "messages.", "messages", "context_length_exceeded")
        texts = [m.get("content") for m in messages if isinstance(m, dict)]
        texts += [p.get("text") for parts in texts if isinstance(parts, list) for p in parts if isinstance(p, dict)]
        check_text_fits("".join(t for t in texts if isinstance(t, str)), self.engine.tokenizer.max_token_bytes, ctx,
                        "the text of 'messages'", "messages")

    def rendered(self, body: dict) -> str:
        """A chat request's ``messages`` through the model's chat template (with its
        ``add_generation_prompt`` and ``chat_template_kwargs``, as llama-server renders them)."""
        if self.chat_template is None:
            raise BadRequest(f"model {self.model_id} {self.template_problem}; use /v1/completions", "messages")
        add_generation_prompt, extra = parse_template_options(body)
        try:
            return self.chat_template.render(body.get("messages"), add_generation_prompt=add_generation_prompt,
                                             continue_final_message=True, extra=extra)
        except MalformedMessages as exc:
            raise BadRequest(str(exc), exc.field, MESSAGES_CODES[exc.problem]) from None
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from None

    def readers(self, body: dict, chat: bool, n: int) -> list[Callable[[], list[int]]]:
        """One call per prompt of the request that gives its tokens (each is a tokenizer's
        task of its own, so that other requests' prompts are read between a batch's; this
        looks at the body's shape alone, as cheap as the walk that checked its text): one for
        chat; a completion's ``prompt`` may be a batch (a list of strings or of token-id
        lists), up to :data:`.api_params.MAX_PROMPTS` generations with ``n`` choices each."""
        if chat:
            self.check_messages_fit(body)
            return [lambda: self.encode(self.rendered(body), "the rendered 'messages'", "messages")]
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        if batch and len(prompt) * n > MAX_PROMPTS:
            raise BadRequest(f"'prompt' may hold at most {MAX_PROMPTS} prompts ({MAX_PROMPTS} generations with 'n')",
                             "prompt")
        return [functools.partial(self.prompt_tokens, p) for p in (prompt if batch else [prompt])]

    def encode(self, text: str, what: str, param: str, add_bos: Optional[bool] = None, *,
               alone: bool = True) -> list[int]:
        """``text``'s tokens, refused unread when it is too long for the context.  A text may
        encode to no token at all (bytes the vocabulary lacks are dropped), and the pipeline
        needs one to start from: a 400, not the driver's ValueError (a 500), unless the text
        is not ``alone`` (a piece of a prompt that has token ids too)."""
        check_text_fits(text, self.engine.tokenizer.max_token_bytes, self.engine.ctx_size, what, param)
        tokens = self.engine.tokenizer.encode(text, add_bos=add_bos)
        if not tokens and alone:
            raise BadRequest(f"{what} encodes to no tokens", param)
        return tokens

    def prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):  # "" is the model's BOS alone where it adds one (llama.cpp's rule)
            return self.encode(prompt, "'prompt'", "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, (int, str)) and not isinstance(t, bool)
                                                       for t in prompt):
            # token ids, or llama-server's mixed prompt: the texts among them tokenized in place
            # (a BOS, where the model adds one, only before a text that opens the prompt).  Each
            # piece is a token at least, and the texts together must fit: a prompt of a million
            # pieces is refused before a million calls to the tokenizer.
            if all(isinstance(piece, int) for piece in prompt):  # ids alone: the route's own check counts them
                if len(prompt) < self.engine.ctx_size:  # (ids too many for it are refused there, unread)
                    check_token_ids(prompt, self.engine.tokenizer.n_vocab, "prompt")
                return list(prompt)
            check_context(len(prompt), None, self.engine.ctx_size, "prompt")
            check_text_fits("".join(p for p in prompt if isinstance(p, str)), self.engine.tokenizer.max_token_bytes,
                            self.engine.ctx_size, "'prompt'", "prompt")
            tokens = [t for i, piece in enumerate(prompt) for t in ([piece] if isinstance(piece, int) else
                      self.encode(piece, "'prompt'", "prompt", add_bos=None if i == 0 else False, alone=False))]
            if not tokens:  # texts alone (a batch's list of them), each empty
                raise BadRequest("'prompt' encodes to no tokens", "prompt")
            check_token_ids(tokens, self.engine.tokenizer.n_vocab, "prompt")
            return tokens
        raise BadRequest("'prompt' must be a string or a list of token ids (texts may stand among them), or a "
                         "list of such prompts", "prompt", INVALID_TYPE)


__all__ = ["PromptReader"]
