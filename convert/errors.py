class ConvertError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def printable(text: str) -> str:
    """text with control characters (newlines, terminal escapes) written as escapes: messages quote names and
    metadata from the files being converted, which must not move a terminal's cursor or fake a line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_chat_template(template: str, where: str) -> None:
    """ConvertError naming where when the chat template does not compile as the server compiles it."""
    import jinja2
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConvertError(
            f"the chat template in {where} does not compile: {exc.message} (line {exc.lineno})"
        ) from None
