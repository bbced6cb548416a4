"""dsaserve: a serving engine for GLM-5.x sparse-attention (glm_moe_dsa) models."""

from dsaserve.llm import LLM
from dsaserve.outputs import CompletionOutput, Logprob, RequestOutput
from dsaserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
