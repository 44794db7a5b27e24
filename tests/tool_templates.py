"""Chat templates with tools, written here after the vendors' documented formats (compactly: the
markers and the call syntax are the point, not the vendors' every line), and a conversation in
them, for tests/test_tool_formats.py; nothing is downloaded."""
from __future__ import annotations

# Qwen2.5 / Qwen3 (Hermes style): the tools as JSON lines inside <tools></tools> in the system turn,
# each call in <tool_call> tags, tool results as <tool_response> in a user turn.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- c.function.arguments | tojson + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Llama 3.1 / 3.2 (JSON tool calling): the tools in the first user message, a call as
# {"name": ..., "parameters": ...}, a tool's result under the ipython header.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- if tools %}{%- set first = messages[0].content %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON '"
    " + 'for a function call with its proper arguments that best answers the given prompt.\\n\\n'"
    " + 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its '"
    " + 'value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}{{- first + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}{%- set c = m.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + c.name + '\", \"parameters\": '"
    " + c.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
GOLD = {"type": "function", "function": {
    "name": "give_gold", "description": "Hand the player some gold",
    "parameters": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 50}},
                   "required": ["amount"], "additionalProperties": False}}}
TOOLS = [WEATHER, GOLD]
ASK = [{"role": "user", "content": "Weather in Paris, and 5 gold?"}]
HISTORY = [
    {"role": "system", "content": "You are the innkeeper."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    {"role": "assistant", "content": "Sunny, 21."},
    {"role": "user", "content": "Give me 5 gold."},
]
# The calls as each model writes them (its template's spacing: Python's json.dumps).
PARIS = '{"city": "Paris", "unit": "celsius"}'
QWEN_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>'
QWEN_GOLD = '<tool_call>\n{"name": "give_gold", "arguments": {"amount": 5}}\n</tool_call>'
LLAMA_PARIS = '{"name": "get_weather", "parameters": ' + PARIS + '}'
FALLBACK_PARIS = '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'
