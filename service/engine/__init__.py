"""The engine: an async front (front.py) over one engine thread (core.py), which steps the model (runner.py).
Front ends import this package's face only."""

from service.core.config import EngineConfig
from service.core.stats import EngineStats, ModelInfo
from service.engine.disk_store import FolderInUse
from service.engine.front import Engine
from service.engine.model_files import UnreadableModel
from service.engine.protocol import EngineClient, GenerationRequest

__all__ = [
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineStats",
    "FolderInUse",
    "GenerationRequest",
    "ModelInfo",
    "UnreadableModel",
]
