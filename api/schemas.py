"""What a JSON schema means here before it is compiled: objects closed unless they say otherwise,
integers within what JavaScript reads exactly.

JSON Schema lets an object take any property it does not declare unless `additionalProperties`
says no, and most real schemas (function signatures above all) never say it. A small model then
fills the room: it repeats a key the schema never named, or nests "description" in "description"
until max_tokens, and the reply never ends. xgrammar and Outlines read such objects as closed;
llguidance keeps JSON Schema's reading and has no option to change it, so the schema is rewritten
here: every object that declares `properties` and says nothing of `additionalProperties`,
`unevaluatedProperties` or `patternProperties` gets `"additionalProperties": false`.

Left as written, on purpose:
- an object that declares no properties (`{"type": "object"}`: any object, as json_object asks);
- the members of an `allOf` and a schema that has one: their properties are merged, and closing
  one part would refuse the properties another part declares (JSON Schema's additionalProperties
  sees its own siblings only);
- everything a schema says explicitly: `"additionalProperties": true` keeps an object open.

`Settings.open_objects` (OPEN_OBJECTS=1) leaves objects as JSON Schema reads them, for the whole API.

An integer without a bound gets ±(2**53 - 1), JavaScript's Number.MAX_SAFE_INTEGER, on the side it
lacks: past it a client in JavaScript (a game's front end) reads another number than was written,
and a grammar with no bound let SmolLM2 write digits until max_tokens. A bound a schema gives
stands. Strings keep their lengths unbounded: a reply's length is the model's to choose, and
max_tokens ends it (finish_reason "length") where the schema set no end.
"""
from __future__ import annotations

SAFE_INTEGER = 2 ** 53 - 1
OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
NAMED = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")  # name -> schema
LISTED = ("anyOf", "oneOf", "prefixItems")  # lists of alternatives or positions
SINGLE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "contains",
          "propertyNames", "not", "if", "then", "else")


def read(schema, open_objects: bool = False):
    """A copy of `schema` as the module says it is read (the client's schema is not changed)."""
    return _read(schema, not open_objects, True)


def _read(schema, close: bool, close_this: bool):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _read(sub, close, True) for name, sub in out[key].items()}
    for key in LISTED:
        if isinstance(out.get(key), list):
            out[key] = [_read(sub, close, True) for sub in out[key]]
    for key in SINGLE:
        value = out.get(key)
        if isinstance(value, list):  # items as a list of positions (drafts before 2020-12)
            out[key] = [_read(sub, close, True) for sub in value]
        elif isinstance(value, dict):
            out[key] = _read(value, close, True)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_read(sub, close, False) for sub in out["allOf"]]
        close_this = False
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    if close and close_this and isinstance(out.get("properties"), dict) and out["properties"] \
            and not any(key in out for key in OPEN_KEYS):
        out["additionalProperties"] = False
    return out
