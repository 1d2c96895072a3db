"""hetserve: a small LLM inference engine and OpenAI-compatible server for GGUF models."""

from .sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import hetserve` stays cheap (the CLI imports torch only when it needs it).
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
