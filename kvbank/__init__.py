"""kvbank: a KV-cache-first LLM inference engine."""

from kvbank.engine.llm import LLM, StreamSession
from kvbank.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.streams import FrameInfo

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StreamSession", "FrameInfo"]
__version__ = "0.1.0"
