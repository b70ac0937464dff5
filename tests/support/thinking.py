"""Servers of the tiny Qwen3 with Qwen3's hybrid-thinking template (templates/qwen3-thinking.jinja), and with a
variant that opens the reasoning block in the prompt when thinking is on (as Qwen3's thinking-only models'
templates do), so that a random-weight model's reply is reasoning whatever it writes."""

from collections.abc import Iterator
from pathlib import Path

import openai

from tests.support.paths import ROOT
from tests.support.servers import TIMEOUT, Running, base_config, free_port

THINKING = ROOT / "templates/qwen3-thinking.jinja"


def opened_template(folder: Path) -> Path:
    source = THINKING.read_text()
    closing = "{{- '<think>\\n\\n</think>\\n\\n' }}"
    assert closing in source
    path = folder / "opened.jinja"
    path.write_text(source.replace(closing, closing + "\n    {%- else %}\n        {{- '<think>\\n' }}"))
    return path


def serve(model: Path, template: Path) -> Iterator[tuple[Running, openai.OpenAI]]:
    """A server of model with template, and an openai SDK client of its HTTP API."""
    running = Running(base_config(model, http_port=free_port(), max_num_seqs=4, chat_template=str(template)))
    try:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as sdk:
            yield running, sdk
    finally:
        running.stop()
