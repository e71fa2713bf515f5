"""A multi-turn chat with thinking and a tool call; each turn prefills only what is new.

    python examples/chat.py [CHECKPOINT]          # default: the tiny built-in synthetic model (gibberish)
"""
import sys

import lily
from lily.cli import tiny_checkpoint

path = sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint()
model = lily.Model.load(path)
chat = model.new_session()                      # one conversation; model.new_session() for others
params = model.default_sampling(max_tokens=256 if len(sys.argv) > 1 else 16)

messages = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is 17 * 23?"}]
r = chat.chat(messages, params)                 # thinking on: r.reasoning, then r.content
print("reasoning:", repr(r.reasoning), "\nanswer:", repr(r.content), "\n", r.usage)

messages += [r.message, {"role": "user", "content": "And without thinking: 18 * 23?"}]
stream = chat.chat(messages, params, stream=True, enable_thinking=False)
for event in stream:
    print(event.text, end="", flush=True)
r = stream.result()
print("\n", r.usage, f"(reused {r.usage.cached_tokens} of {r.usage.prompt_tokens} prompt tokens)")

# Tools: the model answers with <tool_call> XML; the result goes back as a "tool" message.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
messages = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": '{"temperature_c": 21, "sky": "clear"}'}]
print(model.tokenizer.apply_chat_template(messages, tools=tools)[-200:])
print(repr(chat.chat(messages, params, tools=tools).content))
