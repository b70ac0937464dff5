"""JSON schemas the structured-output tests constrain replies to, over the engine, gRPC and HTTP."""

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "floor": {"type": "integer", "minimum": -2, "maximum": 120},
                },
                "required": ["zip", "floor"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "exclusiveMinimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
