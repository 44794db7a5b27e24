"""The call syntax a model was trained on, read from its chat template.

A model calls a function by writing text its fine-tuning taught it; the grammar (api/grammars.py)
lets it write that text and nothing else, and the readers (api/tool_readers.py) turn it back into
OpenAI's `tool_calls`. Three formats:

- "json", the fallback: the reply is one compact JSON object `{"name":"f","arguments":{...}}`.
  For SmolLM2 and any template that knows no tools (the API then shows the tools and this format
  in a system message of its own, api/tools.py), and for a template that reads `tools` but whose
  call syntax is neither of the two below (it renders the tools its own way; the call is this).
- "hermes" (Qwen2.5, Qwen3, and other Hermes-style templates): each call in its own tags,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, several calls one after the
  other ("\\n" between), text allowed before the first (a sentence, or Qwen3's
  `<think>...</think>`, whose tags are tokens of their own there).
- "llama3" (Llama 3.1 / 3.2's JSON tool calling): the reply is one JSON object
  `{"name": "f", "parameters": {...}}`; one call a reply (Llama's own template refuses more).

The two trained formats write JSON as the templates' `tojson` does (Python's json.dumps: ", " and
": " between items and keys), so the grammar asks for exactly the spacing the model has seen in
its history; the fallback stays compact.

Detection (`detect`) looks only at the template's text, and only when it reads `tools`:
- it mentions `<tool_call>` and writes an `"arguments"` key, and is not Qwen3-Coder's XML calls
  (`<function=name><parameter=...>` inside the tags): hermes;
- it has Llama 3's header token `<|start_header_id|>` and writes a call's `"parameters"` key: llama3;
- anything else: json (today's behaviour; unknown formats are never guessed at).

To see which one a model got: `python -m api.tool_formats PATH` (a tokenizer directory, or a
directory with a GGUF file and its name as the second argument) prints the format's name.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str        # the call object's key for the arguments
    item_separator: str       # JSON's separators as the model writes them
    key_separator: str
    opener: str = ""          # the text before each call ("": the whole reply is the call)
    closer: str = ""          # the text after each call
    between: str = ""         # what the grammar puts between two calls
    parallel: bool = False    # several calls in one reply
    text_before: bool = False  # free text may come before the first call (auto)
    thought: tuple = ()       # (open, close) of a thought the model may write first (auto)

    def call_head(self, name: str) -> str:
        """A call's text up to its arguments' object, whitespace left out (the readers compare
        what the model wrote, whitespace squeezed, with this)."""
        return '{"name":"' + name + '","' + self.arguments_key + '":'


JSON = ToolFormat("json", "arguments", ",", ":")
HERMES = ToolFormat("hermes", "arguments", ", ", ": ", opener="<tool_call>", closer="</tool_call>",
                    between="\n", parallel=True, text_before=True, thought=("<think>", "</think>"))
LLAMA3 = ToolFormat("llama3", "parameters", ", ", ": ")
FORMATS = {f.name: f for f in (JSON, HERMES, LLAMA3)}


def _writes_key(text: str, key: str) -> bool:
    """Whether a template writes the JSON key `key`: '"key": ' in a call, or inside a Jinja string
    where the quotes may be escaped (Qwen's `{\\"name\\": <function-name>, \\"arguments\\": ...}`)."""
    return re.search(r'\\?"' + re.escape(key) + r'\\?"', text) is not None


def template_text(template: Union[str, dict, None]) -> str:
    """The template that renders a request with tools: of several by name, transformers picks
    "tool_use" when there is one, else "default"."""
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default") or "\n".join(template.values())
    return template or ""


def detect(template: Union[str, dict, None], reads_tools: bool) -> ToolFormat:
    """The call syntax of a chat template (module docstring). `reads_tools`: the template uses the
    `tools` variable (api/tokenizers.py); one that does not is shown the tools by the API, in the
    fallback format."""
    if not reads_tools:
        return JSON
    text = template_text(template)
    if "<tool_call>" in text and _writes_key(text, "arguments") and "<function=" not in text:
        return HERMES
    if "<|start_header_id|>" in text and _writes_key(text, "parameters"):
        return LLAMA3
    return JSON


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m api.tool_formats TOKENIZER_DIR [GGUF_FILE_NAME] | FILE.gguf", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from api.tokenizers import Tokenizer
    if len(argv) == 1 and argv[0].endswith(".gguf"):  # a file's path: its folder and its name
        argv = [os.path.dirname(os.path.abspath(argv[0])), os.path.basename(argv[0])]
    hf = AutoTokenizer.from_pretrained(argv[0], **({"gguf_file": argv[1]} if len(argv) == 2 else {}))
    print(Tokenizer(hf).tool_format.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
