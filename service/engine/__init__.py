"""The engine: an async front (front.py) over one engine thread (core.py)."""

from service.core.config import EngineConfig
from service.core.stats import EngineStats, ModelInfo
from service.engine.front import Engine

__all__ = ["Engine", "EngineConfig", "EngineStats", "ModelInfo"]
