"""What a JSON schema means here before it is compiled: objects closed unless they say otherwise.

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

`Settings.open_objects` (OPEN_OBJECTS=1) turns the rewrite off for the whole API.
"""
from __future__ import annotations

OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
NAMED = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")  # name -> schema
LISTED = ("anyOf", "oneOf", "prefixItems")  # lists of alternatives or positions
SINGLE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "contains",
          "propertyNames", "not", "if", "then", "else")


def closed(schema, close_this: bool = True):
    """A copy of `schema` with its objects closed as the module says (the input is not changed)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in LISTED:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in SINGLE:
        value = out.get(key)
        if isinstance(value, list):  # items as a list of positions (drafts before 2020-12)
            out[key] = [closed(sub) for sub in value]
        elif isinstance(value, dict):
            out[key] = closed(value)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, close_this=False) for sub in out["allOf"]]
        close_this = False
    if close_this and isinstance(out.get("properties"), dict) and out["properties"] \
            and not any(key in out for key in OPEN_KEYS):
        out["additionalProperties"] = False
    return out
