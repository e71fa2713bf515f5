"""Talk to `lily serve` with the official openai client: a streamed chat with reasoning, a second turn
that reuses the first one's prefix, and a tool call.

    lily serve                                     # in another terminal (tiny built-in model: gibberish)
    python examples/server_client.py [BASE_URL] [MODEL]

With the tiny model the text is random, so the tool call below is rarely made; with Qwen3.6 it is.
"""
import json
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="-")  # the key matters only with `lily serve --api-key`
model = sys.argv[2] if len(sys.argv) > 2 else client.models.list().data[0].id

messages = [{"role": "user", "content": "What is 17 * 23?"}]
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, stream=True,
                                        stream_options={"include_usage": True})
reasoning, content = [], []
DIM, RESET = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")  # no escape codes into a pipe
for chunk in stream:
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated]")
        continue
    delta = chunk.choices[0].delta
    thought = getattr(delta, "reasoning_content", None)  # lily's extension field, like vLLM's
    if thought:
        reasoning.append(thought)
        print(f"{DIM}{thought}{RESET}", end="", flush=True)
    if delta.content:
        content.append(delta.content)
        print(delta.content, end="", flush=True)

# The next turn re-sends the history; the server resumes from its snapshot of the first turn.
messages += [{"role": "assistant", "content": "".join(content), "reasoning_content": "".join(reasoning)},
             {"role": "user", "content": "And 18 * 23? No thinking, please."}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
print(repr(r.choices[0].message.content), f"(reused {r.usage.prompt_tokens_details.cached_tokens} of "
                                          f"{r.usage.prompt_tokens} prompt tokens)")

tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                   tools=tools, max_tokens=256)
msg = r.choices[0].message
print("finish_reason:", r.choices[0].finish_reason)
for call in msg.tool_calls or []:
    print("call:", call.function.name, json.loads(call.function.arguments))
