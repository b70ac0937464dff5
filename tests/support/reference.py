"""An independent reference: the stateful IR that convert/ writes, run token by token with plain OpenVINO."""

from pathlib import Path

import numpy as np
import openvino as ov


class StatefulReference:
    def __init__(self, model_dir: Path, **properties: object) -> None:
        # f32 activations: the CPU plugin's default is bf16 where the CPU has it, and bf16 rounds a prompt
        # step and one-token steps differently
        properties = {"KV_CACHE_PRECISION": "f16", "INFERENCE_PRECISION_HINT": "f32"} | properties
        self.compiled = ov.Core().compile_model(model_dir / "openvino_model.xml", "CPU", properties)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
        request = self.compiled.create_infer_request()
        request.reset_state()
        tokens = list(prompt)
        feed = np.array([tokens], dtype=np.int64)
        positions = np.arange(len(tokens), dtype=np.int64)[None]
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = request.infer(
                {
                    "input_ids": feed,
                    "attention_mask": np.ones((1, len(tokens)), dtype=np.int64),
                    "position_ids": positions,
                    "beam_idx": np.zeros(1, dtype=np.int32),
                }
            )["logits"]
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                break
            tokens.append(token)
            feed = np.array([[token]], dtype=np.int64)
            positions = np.array([[len(tokens) - 1]], dtype=np.int64)
        return out
