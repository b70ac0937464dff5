"""The model's graph, made ready for the runner: the IR read (or a clear reason it cannot be), transformed into a
paged-attention model, and its final MatMul fed only the rows that will be sampled."""

from __future__ import annotations

from pathlib import Path

import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from service.engine.model_files import CONVERT_AGAIN, PAGED_ATTENTION_INPUTS, UnreadableModel

SAMPLED_ROWS = "sampled_rows"


def paged_model(core: ov.Core, ir: Path) -> ov.Model:
    """The IR as a paged-attention model whose logits are those of the SAMPLED_ROWS input's rows."""
    model = _read_ir(core, ir)
    paged_attention_transformation(model, False, False)
    _gather_before_lm_head(model)
    _check_inputs(model)
    return model


def _read_ir(core: ov.Core, ir: Path) -> ov.Model:
    """The IR, or UnreadableModel: OpenVINO's own reason is a page of frontend names (after other frontends'
    parse errors on stderr), not what is wrong with the file. An IR's graph file is one <net> element: a file
    that does not end with its closing tag is cut short or of another format, told before OpenVINO tries it."""
    unreadable = UnreadableModel(
        f"{ir} is not an OpenVINO model OpenVINO can read (damaged, cut short, or another format); {CONVERT_AGAIN}"
    )
    with ir.open("rb") as graph:
        graph.seek(max(0, ir.stat().st_size - 64))
        if not graph.read().rstrip().endswith(b"</net>"):
            raise unreadable
    try:
        return core.read_model(ir)
    except RuntimeError:
        raise unreadable from None


def _gather_before_lm_head(model: ov.Model) -> None:
    """Make the final MatMul see only the rows that will be sampled, not every prompt token."""
    node = model.get_results()[0].input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        if node.get_input_size() == 0:
            raise ValueError("no MatMul found before the logits output")
        node = node.input_value(0).get_node()
    rows = ops.parameter([-1], ov.Type.i64, name=SAMPLED_ROWS)
    rows.output(0).set_names({SAMPLED_ROWS})
    hidden = node.input_value(0)
    gathered = ops.gather(hidden, rows, ops.constant(0, ov.Type.i64))
    node.input(0).replace_source_output(gathered.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()


def _check_inputs(model: ov.Model) -> None:
    names = {n for i in model.inputs for n in i.get_names()}
    missing = [n for n in PAGED_ATTENTION_INPUTS if n not in names]
    if missing or not any(n.startswith("key_cache.") for n in names):
        raise ValueError(
            f"the model is not a paged-attention LLM after transformation: missing inputs "
            f"{missing or ['key_cache.*']}; convert it with `python -m convert`"
        )
