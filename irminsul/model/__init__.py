"""The MLA model runtime: config, rotary, attention, MoE, loader."""

from .config import ConfigError, MLAConfig, load_config, parse_config
from .default import default_model_dir
from .loader import CheckpointError, load_model
from .model import ForwardOutput, MLAModel

__all__ = ["CheckpointError", "ConfigError", "ForwardOutput", "MLAConfig", "MLAModel",
           "default_model_dir", "load_config", "load_model", "parse_config"]
