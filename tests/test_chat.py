"""Chat templates: the SmolLM2 GGUF's template renders as transformers renders it."""

import re

import numpy as np
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from skippy_wire.stage.chat import (MAX_INTEGER_BITS, MAX_RANGE_ITEMS, MAX_RENDERED_CHARS, MESSAGE_PROBLEMS,
                                    ChatTemplate, ChatTemplateError, MalformedMessages)
from skippy_wire.stage.models import read_gguf_metadata, smollm2_path, write_tiny_llama_gguf

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy? ünïcödé"},
]


def _transformers(source, messages, add_generation_prompt):
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [TWO_TURNS, [{"role": "system", "content": "Be brief."}, *TWO_TURNS]])
def test_smollm2_template_matches_transformers(messages, add_generation_prompt):
    template = ChatTemplate.from_gguf(smollm2_path())
    source = read_gguf_metadata(smollm2_path(), "tokenizer.chat_template")["tokenizer.chat_template"]
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _transformers(source, messages, add_generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_features_as_transformers():
    # trim_blocks/lstrip_blocks, loopcontrols, tojson keeping non-ASCII, raise_exception
    source = ("{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
              "{{ m['content'] | tojson }}|{% endfor %}{{ bos_token }}")
    msgs = [{"role": "user", "content": c} for c in ("é", "b", "c")]
    assert ChatTemplate(source).render(msgs) == _transformers(source, msgs, True) == '"é"|"b"|'
    failing = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        failing.render(msgs)


def test_content_parts_are_joined_with_newlines_as_llama_cpp_joins_them():
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(parts) == "[a\nb]"


def test_a_final_assistant_message_is_continued_when_asked():
    template = ChatTemplate.from_gguf(smollm2_path())
    started = TWO_TURNS[:2]
    assert template.render(started, continue_final_message=True) == \
        template.render(TWO_TURNS[:1]) + "The capital of France is Paris."
    # otherwise (transformers' default) the assistant turn is closed and a new one opened
    assert template.render(started).endswith("Paris.<|im_end|>\n<|im_start|>assistant\n")
    # a system prompt counts as a message before it
    briefed = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Sure"}]
    assert template.render(briefed, continue_final_message=True) == template.render(briefed[:1]) + "Sure"


def test_two_assistant_messages_at_the_end_are_refused_as_llama_server_refuses_them():
    template = ChatTemplate.from_gguf(smollm2_path())
    twice = [TWO_TURNS[0], {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}]
    refusal = r"^Cannot have 2 or more assistant messages at the end of the list\.$"
    with pytest.raises(MalformedMessages, match=refusal) as info:
        template.render(twice, continue_final_message=True)  # it continued "B" after "A"'s closed turn
    assert (info.value.field, info.value.problem) == ("messages[1].role", "value")
    assert template.render(twice).endswith("B<|im_end|>\n<|im_start|>assistant\n")  # not asked to continue: fine


def test_a_lone_assistant_message_is_continued_too():
    # as llama-server: no messages before it, rendered with the generation prompt, its text after
    template = ChatTemplate.from_gguf(smollm2_path())
    lone = [{"role": "assistant", "content": "Once upon"}]
    assert template.render(lone, continue_final_message=True) == "<|im_start|>assistant\nOnce upon"
    assert template.render(lone).endswith("Once upon<|im_end|>\n<|im_start|>assistant\n")  # not asked: closed
    empty = [{"role": "assistant", "content": None}]  # content may be null: the prompt alone
    assert template.render(empty, continue_final_message=True) == "<|im_start|>assistant\n"
    # a template that cannot render no messages says why it was asked to
    first = ChatTemplate("{{ messages[0]['role'] }}{% if add_generation_prompt %}>{% endif %}")
    assert first.render([{"role": "user", "content": "Hi"}, *lone], continue_final_message=True) == "user>Once upon"
    with pytest.raises(ChatTemplateError, match="to continue a lone assistant message") as info:
        first.render(lone, continue_final_message=True)
    assert "\n" not in str(info.value)


def test_an_assistant_refusal_part_is_its_text():
    # OpenAI's form of a refusal in an assistant message's content: the assistant's text
    template = ChatTemplate("{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}")
    turns = [{"role": "user", "content": "Hack it"},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
             {"role": "user", "content": "Why?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Because"},
                                               {"type": "refusal", "refusal": "it is harmful."}]}]
    assert template.render(turns) == \
        "[user: Hack it][assistant: I can't help with that.][user: Why?][assistant: Because\nit is harmful.]"
    # the continued message's parts are joined with nothing between, as llama-server appends them
    assert template.render(turns, continue_final_message=True).endswith("[user: Why?]Becauseit is harmful.")


def test_text_parts_are_joined_as_llama_cpp_joins_them():
    """A newline before each part once there is text: leading empty parts added newlines, and a
    continued assistant message's parts were joined with newlines (llama-server appends them)."""
    template = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    parts = [{"type": "text", "text": t} for t in ("", "", "A", "", "B")]
    assert template.render([{"role": "user", "content": parts}]) == "[A\n\nB]"
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
    assert template.render(turns, continue_final_message=True) == "[Hi]Hello there"
    assert template.render(turns) == "[Hi][Hello\n there]"  # not continued: a message as any other


def test_a_bos_the_template_writes_is_dropped_where_the_tokenizer_adds_one():
    """llama.cpp drops it: with both, the model saw two BOS tokens."""
    source = "{{ bos_token }}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    turns = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate(source, bos_token="<s>", add_bos=True).render(turns) == "<Hi>"
    assert ChatTemplate(source, bos_token="<s>").render(turns) == "<s><Hi>"


def test_a_template_made_for_training_renders_its_generation_blocks():
    """``{% generation %}`` (transformers' mark of the assistant's turns) did not compile: the
    model was taken to have no chat template."""
    template = ChatTemplate("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                            "<{{ m['content'] }}>{% endgeneration %}{% else %}[{{ m['content'] }}]{% endif %}"
                            "{% endfor %}")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert template.render(turns) == "[Hi]<Yo>"


def test_a_message_name_is_passed_on_when_it_is_a_string():
    template = ChatTemplate("{% for m in messages %}[{{ m.get('name', '-') }}: {{ m['content'] }}]{% endfor %}")
    assert template.render([{"role": "user", "content": "Hi", "name": "ann"}]) == "[ann: Hi]"
    # null is absent, as clients that send every field send those they leave unset
    assert template.render([{"role": "user", "content": "Hi", "name": None}]) == "[-: Hi]"


def test_a_developer_message_is_the_system_turn():
    # OpenAI's newer name for the system instructions; templates know only "system"
    # (llama.cpp maps it the same way), so SmolLM2 renders it as its system turn.
    template = ChatTemplate("{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}")
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(turns) == "[system: Be brief.][user: Hi]"
    # the deprecated function message is the tool result it became
    result = [{"role": "function", "name": "f", "content": "42"}]
    assert template.render(result) == "[tool: 42]"
    smollm2 = ChatTemplate.from_gguf(smollm2_path())
    assert smollm2.render(turns) == smollm2.render([{**turns[0], "role": "system"}, turns[1]])


@pytest.mark.parametrize("messages, fragment, field, problem", [
    ([], "non-empty list", "messages", "empty"),
    (None, "non-empty list", "messages", "missing"),
    ({"role": "user"}, "non-empty list", "messages", "type"),
    ([{"role": "wizard", "content": "x"}], "role must be one of", "messages[0].role", "value"),
    ([{"content": "x"}], "role must be one of", "messages[0].role", "missing"),
    (["hi"], r"messages\[0\] must be an object", "messages[0]", "type"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of content parts", "messages[0].content",
     "type"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts", "messages[0].content[0].type", "value"),
    ([{"role": "user", "content": ["x"]}], "content parts", "messages[0].content[0]", "type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "content parts", "messages[0].content[0].text",
     "type"),
    ([{"role": "user"}], "content is required", "messages[0].content", "missing"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "content is required",
     "messages[0].content", "missing"),
    ([{"role": "developer", "content": []}], "content is required", "messages[0].content", "empty"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
     r"messages\[0\]\.content parts of type 'refusal' are only allowed in assistant messages",
     "messages[0].content[0].type", "value"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": ["a", {"type": "refusal", "refusal": "no"}]}],
     r"messages\[1\]\.content parts", "messages[1].content[0]", "type"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": [{"type": "refusal", "refusal": "no"}]}],
     r"messages\[1\]\.content parts of type 'refusal' are only allowed in assistant messages",
     "messages[1].content[0].type", "value"),
    ([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "text": "no"}]}],
     "type 'refusal' must be", "messages[0].content[1].refusal", "missing"),
    ([{"role": "assistant", "content": [{"type": "refusal", "refusal": 1}]}], "type 'refusal' must be",
     "messages[0].content[0].refusal", "type"),
    ([{"role": "user", "content": [{"text": "x"}]}], "content parts", "messages[0].content[0].type", "missing"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content parts", "messages[0].content[0].text", "missing"),
    (np.array([1, 2]), "non-empty list", "messages", "type"),  # compared with [] it was numpy's ValueError
    ([{"role": "assistant", "content": [{"type": "image_url"}]}], "or {'type': 'refusal'",
     "messages[0].content[0].type", "value"),
    ([{"role": "user", "content": "x", "name": 7}], r"messages\[0\]\.name must be a string", "messages[0].name",
     "type"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "name": ["a"]}],
     r"messages\[1\]\.name must be a string", "messages[1].name", "type"),
])
def test_bad_messages_are_one_line_errors(messages, fragment, field, problem):
    """One line, and the culprit field and its problem, from which an API names OpenAI's param and code."""
    with pytest.raises(MalformedMessages, match=fragment) as info:
        ChatTemplate("{{ messages }}").render(messages)
    assert "\n" not in str(info.value)
    assert (info.value.field, info.value.problem) == (field, problem)
    assert problem in MESSAGE_PROBLEMS and isinstance(info.value, ChatTemplateError)


def test_model_without_template(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_gguf(path)


def test_sandbox_refuses_attribute_escape():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


USER = [{"role": "user", "content": "x" * 200}]


@pytest.mark.parametrize("source, fragment", [
    # each range within the sandbox's 100,000, together 10^10 turns: hours
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     f"the template's ranges make more than {MAX_RANGE_ITEMS} items"),
    ("{{ 'Hello ' * 200000000 }}", f"a repetition of more than {MAX_RENDERED_CHARS} items"),
    ("{{ [1] * 200000000 }}", f"a repetition of more than {MAX_RENDERED_CHARS} items"),
    ("{{ 2 ** 1000000000 }}", "an exponent above 1024"),
    ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",  # 20 million characters
     f"it wrote more than {MAX_RENDERED_CHARS} characters"),
    # a number squared in a loop, each exponent small: minutes of big-integer arithmetic
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     f"an integer of more than {MAX_INTEGER_BITS} bits"),
    ("{{ ((9 ** 1024) ** 1024) ** 1024 > 1 }}", f"an integer of more than {MAX_INTEGER_BITS} bits"),
    # a string doubled in a loop with +: 2^41 characters
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     f"a sequence of more than {MAX_RENDERED_CHARS} items"),
])
def test_a_template_from_a_model_file_is_bounded_in_time_and_memory(source, fragment):
    with pytest.raises(ChatTemplateError, match=f"^the chat template failed: {re.escape(fragment)}$"):
        ChatTemplate(source).render(USER)


def test_the_range_budget_is_each_renders_own():
    template = ChatTemplate("{% for i in range(6) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                            "{{ messages[0].content[:1] }}")
    assert [template.render(USER) for _ in range(3)] == ["x"] * 3  # 1.8 million items over three renders
    assert ChatTemplate("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ 'c' + 'd' }}{{ 3 * 4 + 1 }}{{ 2 ** -1 }}").render(USER) \
        == "ababab1024cd130.5"
